"""Prints the evaluation-set matrix from what matrix.sh wrote (docs/benchmarks-history.md has the
full matrices, docs/benchmarks.md the default policy's rows).

Usage: python3 table.py EVAL_DIR WORKLOAD:RATE:ENGINES ...  (the specs matrix.sh was given)

Per spec it reads kv-TAG.json and sticky-TAG.json (kvroute replay --json) and ref-rr-TAG.json and
ref-kvN-TAG.json (one line of reference_replay.py each), TAG being WORKLOAD-xRATE-ENGINES, and
prints one Markdown row per system and policy: the reference's round-robin, its kv_router (the
run with the highest hit rate, with the range over runs), then kvroute's policies and the default
with sticky sessions. hit/oracle divides by kvroute's token-basis oracle of the same trace.
"""

import glob
import json
import os
import sys


def ms(v):
    return f"{v:,.0f} ms" if v < 10000 else f"{v / 1000:.1f} s"


def row(label, n, system, policy, hit, oracle, p50, p99, continuity):
    cont = "-" if continuity is None else f"{continuity * 100:.1f}%"
    return (f"| {label} | {n} | {system} | {policy} | {hit * 100:.2f}% | "
            f"{hit / oracle * 100:.1f}% | {ms(p50)} | {ms(p99)} | {cont} |")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    os.chdir(sys.argv[1])
    print("| workload | engines | system | policy | hit rate | hit/oracle | TTFT p50 | TTFT p99 "
          "| continuity |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for spec in sys.argv[2:]:
        workload, rate, engines = spec.split(":")
        tag = f"{workload}-x{rate}-{engines}"
        label = workload if rate == "1" else f"{workload} ({rate}x rate)"
        kv = json.load(open(f"kv-{tag}.json"))
        oracle = kv["oracle"]["token_hit_rate"]
        if os.path.exists(f"ref-rr-{tag}.json"):
            rr = json.loads(open(f"ref-rr-{tag}.json").read())
            print(row(label, engines, "reference", "round_robin", rr["prefix_cache_reused_ratio"],
                      oracle, rr["median_ttft_ms"], rr["p99_ttft_ms"], None))
        runs = [json.loads(open(f).read()) for f in sorted(glob.glob(f"ref-kv*-{tag}.json"))]
        if runs:
            hits = [r["prefix_cache_reused_ratio"] for r in runs]
            best = max(runs, key=lambda r: r["prefix_cache_reused_ratio"])
            name = (f"kv_router (best of {len(runs)}; range {min(hits) * 100:.2f}-"
                    f"{max(hits) * 100:.2f}%)")
            print(row(label, engines, "reference", name, best["prefix_cache_reused_ratio"],
                      oracle, best["median_ttft_ms"], best["p99_ttft_ms"], None))
        sticky = json.load(open(f"sticky-{tag}.json"))["policies"][0]
        policies = kv["policies"] + [dict(sticky, policy=f"{sticky['policy']} + sticky sessions")]
        for p in policies:
            print(row(label, engines, "kvroute", p["policy"], p["hit_rate"], oracle,
                      p["ttft_p50_ms"], p["ttft_p99_ms"], p.get("session_continuity")))


if __name__ == "__main__":
    main()
