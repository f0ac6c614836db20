#!/usr/bin/env python3
"""Faults: kvroute in front of real llama.cpp servers that freeze, die, refuse or are misconfigured.

Usage: python3 faults.py KVROUTE_BINARY [--cases 1,2,...]

Makes the tiny model (make_model.py), starts three llama.cpp servers (servers.py; one slot each)
and runs each case against a `kvroute serve` of its own (policy round-robin where the case needs
requests to reach a given engine), asserting what the client sees, what the router's `/metrics`
say, and that the router's load gauges return to zero:

1. first-byte timeout: an engine frozen (SIGSTOP) before its first byte, sidecars run with
   `--first-byte-timeout 1500ms`: every request still succeeds (moved to another worker), the
   router counts `worker_failures_total{reason="timeout"}` and, after three in a row,
   `worker_ejections_total`; a request pinned to the frozen worker, and one sent while every
   engine is frozen, get 504 `timeout`; once resumed (SIGCONT) the worker is let back in on
   probation and serves again.
2. idle timeout: an engine frozen mid-stream, sidecars with `--idle-timeout 1500ms`: the client's
   stream completes as one answer (the same text as the same request served without a fault,
   `finish_reason` once, every token counted once) on another worker.
3. a dead engine in a static fleet (`[[discovery.workers]] engine = "llamacpp"`, SIGKILL): every
   request succeeds, even with `max_migrations = 0` (a refused connection costs no migration),
   and the dead worker is ejected with `reason="unreachable"`.
4. an engine's refusal: a prompt over the engine's context (a server with a 512-token slot) gets
   400 `context_length_exceeded`, chat or completion, streamed or not: refused by the worker,
   which learnt the context at start, and by the engine itself once restarted with a smaller
   context; counted `requests_finished_total{outcome="rejected"}`, with no failure or ejection
   of the worker, which then serves a prompt that fits.
5. the wrong dialect: `kvroute worker --engine sglang` (and a static fleet entry
   `engine = "sglang"`) pointed at llama.cpp exits non-zero, saying it "answers like llamacpp".
6. refused configurations: a static fleet of engines without `--model NAME,tokenizer=...`, and a
   fleet entry whose `kv_block_size` is not the router's, make `kvroute serve` exit non-zero.
7. an engine killed (SIGKILL) and restarted on the same port behind its sidecar while requests
   keep coming: every request succeeds, the restarted engine serves again, the load returns to 0.

Every child is stopped on exit (kvroute processes also get SIGTERM if this script dies: they are
started with PR_SET_PDEATHSIG; the servers exit when this script's pipes to them close, and a
guard process resumes any server left frozen), every frozen engine is resumed, and every wait is
bounded; the whole run takes about a minute. Logs go to
$KVROUTE_E2E_LOGS (default: a fresh temporary directory, printed), one directory per case.
"""

import argparse
import concurrent.futures
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree when importing

from e2e import (  # noqa: E402
    BLOCK_SIZE, MODEL, STEP_TIMEOUT, Procs, Router, busy_slots, http_json, samples, toml_str,
    wait_for,
)
from servers import start_servers, stop_servers  # noqa: E402

N_SERVERS = 3
# One slot per engine; 8,192 tokens so that a stream long enough to freeze mid-way fits.
ENGINE = dict(slots=1, ctx_per_slot=8192)
SMALL_CTX = 512  # case 4's engine
RESTART_CTX = 256  # case 4's engine, restarted with less context than its worker learnt
SHORT_LIMIT = "1500ms"  # --first-byte-timeout / --idle-timeout of the engines the cases freeze
MAX_TOKENS = 16
LONG_MAX_TOKENS = 3000  # case 2: a few seconds of generation on these CPUs
MIN_AGREEMENT = 400  # case 2: characters after the migration point that must match (see there)
REFUSAL_TIMEOUT = 30.0  # a misconfigured process must exit within this
RECOVERY_TIMEOUT = 30.0  # an ejected or restarted worker must serve again within this
GAUGES = ("kvroute_router_worker_active_requests", "kvroute_router_worker_prefill_tokens",
          "kvroute_router_worker_active_blocks")


# --- Processes that die with this script ---

THAW_GUARD = """
import os, signal, sys
sys.stdin.read()
for pid in sys.argv[1:]:
    try:
        os.kill(int(pid), signal.SIGCONT)
    except OSError:
        pass
"""

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class CaseProcs(Procs):
    """e2e's Procs (kvroute processes, each started with its readiness line read; all stopped at
    the end), but every process also gets SIGTERM when this script dies, so a harness killing
    the script on its timeout leaves no router or sidecar behind."""

    def start(self, name, args):
        log_path = os.path.join(self.log_dir, f"{name}.log")
        proc = subprocess.Popen([self.binary] + args, stdout=subprocess.PIPE,
                                stderr=open(log_path, "w"), stdin=subprocess.DEVNULL, text=True,
                                preexec_fn=_die_with_parent,
                                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})
        self.procs.append(proc)
        line = {}

        def read():
            line["text"] = proc.stdout.readline()
            for _ in proc.stdout:
                pass

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + STEP_TIMEOUT
        while not line.get("text"):
            if time.monotonic() > deadline or proc.poll() is not None or line.get("text") == "":
                tail = open(log_path).read()[-3000:]
                raise AssertionError(f"`kvroute {' '.join(args)}` printed no readiness line "
                                     f"(exit {proc.poll()}); {log_path} ends with:\n{tail}")
            time.sleep(0.01)
        return proc, dict(w.split("=", 1) for w in line["text"].split() if "=" in w)


def run_refused(binary, log_dir, name, args):
    """Runs `kvroute ARGS`, which must exit non-zero within REFUSAL_TIMEOUT; returns its output."""
    out_path = os.path.join(log_dir, f"{name}.log")
    with open(out_path, "w") as out:
        proc = subprocess.Popen([binary] + args, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout=REFUSAL_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise AssertionError(f"`kvroute {' '.join(args)}` still ran after {REFUSAL_TIMEOUT:.0f} s;"
                                 f" expected it to refuse to start; see {out_path}")
    text = open(out_path).read()
    assert code != 0, f"`kvroute {' '.join(args)}` exited 0; expected a refusal:\n{text[-3000:]}"
    return text, code, time.monotonic() - t0


# --- HTTP ---

def post_raw(url, body, headers=None, timeout=STEP_TIMEOUT):
    """POSTs JSON; returns (status, parsed JSON or text of the body), errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def metric(metrics, name, **labels):
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(v for l, v in samples(metrics, name) if all(l.get(k) == x for k, x in want.items()))


def has_sample(metrics, name, **labels):
    want = {k: str(v) for k, v in labels.items()}
    return any(all(l.get(k) == x for k, x in want.items()) for l, _ in samples(metrics, name))


def failures_of(metrics, worker):
    return {l["reason"]: v for l, v in samples(metrics, "kvroute_router_worker_failures_total")
            if l.get("worker") == str(worker)}


def ejections_of(metrics, worker):
    return {l["reason"]: v for l, v in samples(metrics, "kvroute_router_worker_ejections_total")
            if l.get("worker") == str(worker)}


def outcomes(metrics):
    return {l["outcome"]: v for l, v in samples(metrics, "kvroute_router_requests_finished_total")}


# --- The router ---

class FaultRouter(Router):
    def chat(self, messages, max_tokens=MAX_TOKENS, headers=None):
        """One non-streamed chat through the stock client: (text, finish reason, worker)."""
        reply = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
            extra_headers=headers, extra_body={"nvext": {"extra_fields": ["worker_id"]}})
        nvext = (reply.model_extra or {}).get("nvext") or {}
        worker = (nvext.get("worker_id") or {}).get("decode_worker_id")
        choice = reply.choices[0]
        return choice.message.content, choice.finish_reason, worker

    def chat_ok(self, tag, max_tokens=MAX_TOKENS):
        """A chat that must come back whole: returns its worker."""
        text, finish, worker = self.chat([{"role": "user", "content": f"Say something ({tag})."}],
                                         max_tokens)
        assert text and finish == "length", f"{tag}: text {text!r}, finish_reason {finish!r}"
        return worker

    def post(self, path, body, headers=None):
        return post_raw(self.base + path, body, headers)

    def assert_idle(self, workers, reporting=None):
        """The router holds no load on `workers`, and the engines of `reporting` (default: all
        of `workers`) say through their workers that they hold none either."""
        reporting = workers if reporting is None else reporting

        def idle():
            m = self.metrics()
            for name in GAUGES:
                values = {l["worker"]: v for l, v in samples(m, name) if "worker" in l}
                if any(values.get(str(w), 0.0) != 0.0 for w in workers):
                    return False
            reported = {l["worker"]: v for l, v in
                        samples(m, "kvroute_router_worker_reported_requests") if "worker" in l}
            return all(reported.get(str(w)) == 0.0 for w in reporting)

        try:
            wait_for(f"router {self.name}: zero load on workers {workers}", idle)
        except AssertionError as e:
            lines = [line for line in self.metrics().splitlines()
                     if line.startswith(GAUGES + ("kvroute_router_worker_reported_requests",))]
            raise AssertionError(f"{e}:\n" + "\n".join(lines)) from None


# --- The environment shared by the cases ---

class Env:
    def __init__(self, binary, log_dir, model_dir):
        self.binary, self.log_dir, self.model_dir = binary, log_dir, model_dir
        self.model = os.path.join(model_dir, "model.gguf")
        self.servers = []
        self.frozen = set()
        self.extra_servers = []
        self.thaw_guard = None

    def start_servers(self):
        self.servers = start_servers(self.model, N_SERVERS, log_dir=self.log_dir, **ENGINE)
        # A frozen server would outlive this script if it died (killed by a harness) with the
        # server stopped: a stopped process never reads that its standard input closed. This
        # guard resumes every server once its own pipe from this script closes, however the
        # script ends; the servers then see their closed pipes and exit.
        self.thaw_guard = subprocess.Popen(
            [sys.executable, "-c", THAW_GUARD] + [str(s.proc.pid) for s in self.servers],
            stdin=subprocess.PIPE)

    def freeze(self, server):
        os.kill(server.proc.pid, signal.SIGSTOP)
        self.frozen.add(server)

    def thaw(self, server):
        os.kill(server.proc.pid, signal.SIGCONT)
        self.frozen.discard(server)

    def case_dir(self, name):
        path = os.path.join(self.log_dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def router(self, procs, name, policy, discovery=None, worker_ids=(), router_extra=""):
        config = os.path.join(procs.log_dir, f"serve-{name}.toml")
        serve_config(config, self.model_dir, policy,
                     discovery or "registry_listen = \"127.0.0.1:0\"", router_extra)
        return FaultRouter(procs, name, config, list(worker_ids))

    def sidecar(self, procs, router, server, worker_id, *extra):
        procs.start(f"worker-{worker_id}",
                    ["worker", "--engine", "llamacpp", "--engine-url", server.url,
                     "--router", router.ready["registry"], "--id", str(worker_id),
                     "--engine-wait", "20s"] + list(extra))

    def thaw_all(self):
        """Resumes every frozen server (before stopping the kvroute processes waiting on them)."""
        for server in list(self.frozen):
            try:
                self.thaw(server)
            except ProcessLookupError:
                self.frozen.discard(server)

    def cleanup(self):
        self.thaw_all()
        if self.thaw_guard is not None:
            self.thaw_guard.stdin.close()
            self.thaw_guard.wait(timeout=10)
        stop_servers(self.servers + self.extra_servers)


def serve_config(path, model_dir, policy, discovery, router_extra=""):
    """serve.toml: loopback HTTP, `policy`, `discovery`, the tiny model's tokenizer and template
    (as e2e.py's, plus `router_extra` lines in `[router]`)."""
    with open(path, "w") as f:
        f.write(f"[http]\nlisten = \"127.0.0.1:0\"\n\n"
                f"[router]\nblock_size = {BLOCK_SIZE}\npolicy = \"{policy}\"\n{router_extra}\n"
                f"[discovery]\n{discovery}\n\n"
                f"[[models]]\nname = \"{MODEL}\"\n"
                f"tokenizer = {toml_str(os.path.join(model_dir, 'tokenizer.json'))}\n"
                f"chat_template = {toml_str(os.path.join(model_dir, 'template.jinja'))}\n")


def fleet_entries(servers, ids, block_size=BLOCK_SIZE, engine="llamacpp"):
    return "".join(f"[[discovery.workers]]\nid = {i}\nengine = \"{engine}\"\n"
                   f"engine_url = \"{s.url}\"\nkv_block_size = {block_size}\n\n"
                   for s, i in zip(servers, ids))


def parallel(n, fn):
    """Runs fn(0..n-1) on n threads; returns the results, raising the first failure."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n), timeout=STEP_TIMEOUT * 2))


# --- The cases ---

def case_first_byte_timeout(env):
    """1. An engine frozen before its first byte."""
    procs = CaseProcs(env.binary, env.case_dir("1-first-byte-timeout"))
    try:
        ids = [s.index + 1 for s in env.servers]
        router = env.router(procs, "first-byte", "round-robin", worker_ids=ids)
        victim, wid = env.servers[0], 1
        for s, i in zip(env.servers, ids):
            env.sidecar(procs, router, s, i, "--first-byte-timeout", SHORT_LIMIT)
        router.wait_for_workers(ids)
        for i in range(len(ids)):  # every engine answers before the fault
            router.chat_ok(f"warm {i}")

        env.freeze(victim)
        t0 = time.monotonic()
        served, rounds = [], 0
        while not ejections_of(router.metrics(), wid):
            assert rounds < 4, (f"worker {wid} was not ejected after {rounds} rounds of requests; "
                                f"failures {failures_of(router.metrics(), wid)}")
            served += parallel(6, lambda i, r=rounds: router.chat_ok(f"frozen {r}.{i}"))
            rounds += 1
        m = router.metrics()
        elapsed = time.monotonic() - t0
        failures, ejections = failures_of(m, wid), ejections_of(m, wid)
        assert failures.get("timeout", 0) >= 3, f"worker {wid} failures {failures}"
        assert ejections.get("timeout", 0) >= 1, f"worker {wid} ejections {ejections}"
        assert wid not in served, \
            f"a request answered while worker {wid} was frozen names it as its worker: {served}"
        ejected_seen = metric(m, "kvroute_router_worker_ejected", worker=wid)
        print(f"  1: {len(served)} requests in {rounds} rounds, all answered by workers "
              f"{sorted(set(served))} in {elapsed:.1f} s while worker {wid}'s engine was frozen; "
              f"its failures {failures}, ejections {ejections}, ejected gauge {ejected_seen:.0f}")

        # A request pinned to the frozen worker cannot move: every worker it may use timed out.
        t1 = time.monotonic()
        status, body = router.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "Pinned to a frozen engine."}]},
            headers={"x-worker-instance-id": str(wid)})
        waited = time.monotonic() - t1
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
        assert status == 504 and code == "timeout", \
            f"a request pinned to the frozen worker got {status} {body!r}; expected 504 `timeout`"
        print(f"  1: the request pinned to worker {wid} got 504 `timeout` after {waited:.1f} s")

        # Every engine frozen: the request moves from worker to worker and times out on each.
        others = [s for s in env.servers if s is not victim]
        for s in others:
            env.freeze(s)
        t1 = time.monotonic()
        status, body = router.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "Every engine is frozen."}]})
        waited = time.monotonic() - t1
        for s in others:
            env.thaw(s)
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
        assert status == 504 and code == "timeout", \
            f"a request with every engine frozen got {status} {body!r}; expected 504 `timeout`"
        m = router.metrics()
        timeouts = {w: failures_of(m, w).get("timeout", 0) for w in ids}
        assert all(timeouts[s.index + 1] >= 1 for s in others), f"timeouts per worker {timeouts}"
        print(f"  1: with every engine frozen, a request got 504 `timeout` after {waited:.1f} s; "
              f"timeouts per worker {timeouts}")

        env.thaw(victim)
        t2 = time.monotonic()
        back = []

        def served_again():
            back.append(router.chat_ok(f"thawed {len(back)}"))
            return back[-1] == wid

        wait_for(f"worker {wid} to serve again after its engine was resumed", served_again,
                 timeout=RECOVERY_TIMEOUT)
        m = router.metrics()
        assert metric(m, "kvroute_router_worker_ejected", worker=wid) == 0.0, \
            f"worker {wid} serves but still reads as ejected"
        router.assert_idle(ids)
        print(f"  1: resumed, worker {wid} served again after {time.monotonic() - t2:.1f} s "
              f"({len(back)} requests); load back to zero")
    finally:
        env.thaw_all()
        procs.stop_all()


def read_stream(stream, freeze_after=None, on_freeze=None):
    """Reads a chat stream; after `freeze_after` content chunks calls `on_freeze()` once.
    Returns (content pieces, finish reasons seen, usage, last worker named, longest silence)."""
    pieces, finishes, usage, worker = [], [], None, None
    last, longest = time.monotonic(), 0.0
    for chunk in stream:
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        if chunk.usage:
            usage = chunk.usage
        nvext = (chunk.model_extra or {}).get("nvext") or {}
        worker = (nvext.get("worker_id") or {}).get("decode_worker_id", worker)
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        if freeze_after is not None and len(pieces) >= freeze_after and on_freeze:
            on_freeze()
            on_freeze = None
    return pieces, finishes, usage, worker, longest


def case_idle_timeout(env):
    """2. An engine frozen mid-stream."""
    procs = CaseProcs(env.binary, env.case_dir("2-idle-timeout"))
    servers = env.servers[:2]
    ids = [s.index + 1 for s in servers]
    try:
        router = env.router(procs, "idle", "round-robin", worker_ids=ids)
        for s, i in zip(servers, ids):
            env.sidecar(procs, router, s, i, "--idle-timeout", SHORT_LIMIT)
        router.wait_for_workers(ids)
        messages = [{"role": "user", "content": "Tell me a very long story about a frozen engine."}]
        frozen = {}

        def freeze():
            busy = [s for s in servers if busy_slots(s)]
            assert len(busy) == 1, \
                f"expected one engine generating the stream, found {len(busy)} busy"
            env.freeze(busy[0])
            frozen["server"] = busy[0]

        t0 = time.monotonic()
        stream = router.stream(messages, LONG_MAX_TOKENS)
        pieces, finishes, usage, worker, silence = read_stream(stream, 5, freeze)
        elapsed = time.monotonic() - t0
        victim = frozen["server"]
        wid = victim.index + 1
        env.thaw(victim)
        text = "".join(pieces)
        m = router.metrics()
        failures = failures_of(m, wid)
        assert text, "the client received no text"
        assert finishes == ["length"], f"finish reasons {finishes}: expected one `length`"
        assert usage is not None and usage.completion_tokens == LONG_MAX_TOKENS, usage
        assert len(pieces) <= LONG_MAX_TOKENS, \
            f"{len(pieces)} content chunks for {LONG_MAX_TOKENS} tokens: part of the answer came twice"
        assert worker is not None and worker != wid, \
            f"the stream's last chunk names worker {worker}; worker {wid}'s engine was frozen"
        assert sum(failures.values()) >= 1, \
            f"no failure counted for worker {wid}, whose engine froze mid-stream: {failures}"
        assert outcomes(m).get("ok", 0) >= 1, outcomes(m)
        # Where the stream moved: the router logs each migration with the tokens generated so far.
        router_log = open(os.path.join(procs.log_dir, "idle.log")).read()
        moves = [int(g) for g in re.findall(r"migrating the request.*?generated=(\d+)", router_log)]
        assert len(moves) == 1, f"expected one migration in the router's log, found {moves}"
        migrated_at = len("".join(pieces[:moves[0]]))  # one piece per token here

        # The same request without a fault: with greedy decoding the migrated stream must be
        # that answer, once: the same text before the migration (the frozen engine's part) and
        # for a good while after it (the continuation from the tokens generated so far). A
        # restart, or a token lost or repeated at the migration, parts the two texts right at
        # the migration point. Much later they may part for a reason that is the engine's: the
        # continuation prefills the tokens generated so far in one batch, whose float rounding
        # differs from decoding them one by one, and a near-tie between two tokens then goes the
        # other way (measured on the engines alone, without kvroute: prefilling this prompt plus
        # its first 40, 86 or 200 generated tokens on a fresh engine parts from the plain answer
        # at generated token 1,675, character 3,509).
        reference, ref_finish, ref_worker = router.chat(messages, LONG_MAX_TOKENS)
        assert ref_finish == "length", ref_finish
        for name, t in (("stream", text), ("reference", reference)):
            with open(os.path.join(procs.log_dir, f"{name}.txt"), "w") as f:
                f.write(t)
        differ = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b),
                      None if len(text) == len(reference) else min(len(text), len(reference)))
        agree = min(migrated_at + MIN_AGREEMENT, len(reference))
        assert differ is None or differ >= agree, (
            f"the migrated stream parts from the same request served whole (worker "
            f"{ref_worker}) at character {differ}, before character {agree}: the migration "
            f"came after {moves[0]} tokens, character {migrated_at}; "
            f"stream ...{text[max(0, differ - 60):differ + 60]!r}..., "
            f"reference ...{reference[max(0, differ - 60):differ + 60]!r}... "
            f"(both in {procs.log_dir})")
        same = "the same text as the unfaulted answer" if differ is None else (
            f"the unfaulted answer's text up to character {differ} of {len(reference)}")
        router.assert_idle(ids)
        print(f"  2: engine of worker {wid} frozen after 5 chunks had reached the client; the "
              f"stream moved after {moves[0]} tokens (character {migrated_at}) and went on on "
              f"worker {worker}: {len(pieces)} content chunks, {usage.completion_tokens} tokens, "
              f"one finish `length`, {same}; longest silence {silence:.1f} s, {elapsed:.1f} s "
              f"in all; worker {wid} failures {failures}; load back to zero")
    finally:
        env.thaw_all()
        procs.stop_all()


def case_static_fleet_dead_engine(env):
    """3. A dead engine in a static fleet (run last: it kills a server for good)."""
    procs = CaseProcs(env.binary, env.case_dir("3-static-fleet-dead-engine"))
    ids = [s.index + 1 for s in env.servers]
    try:
        # No migrations at all: a refused connection must cost none (nothing was sent there).
        router = env.router(procs, "static", "round-robin",
                            discovery=fleet_entries(env.servers, ids), worker_ids=ids,
                            router_extra="max_migrations = 0\n")
        router.wait_for_workers(ids)
        for i in range(len(ids)):
            router.chat_ok(f"static warm {i}")
        victim, wid = env.servers[2], 3
        victim.kill()
        n = 9
        t0 = time.monotonic()
        served = [router.chat_ok(f"static {i}") for i in range(n)]
        elapsed = time.monotonic() - t0
        m = router.metrics()
        failures, ejections = failures_of(m, wid), ejections_of(m, wid)
        assert wid not in served, f"a request names the dead worker {wid}: {served}"
        assert failures.get("unreachable", 0) >= 1, f"worker {wid} failures {failures}"
        assert ejections.get("unreachable", 0) >= 1, f"worker {wid} ejections {ejections}"
        assert has_sample(m, "kvroute_router_worker_ejected", worker=wid), \
            f"no kvroute_router_worker_ejected sample for the dead worker {wid}"
        router.assert_idle(ids, reporting=ids[:2])
        print(f"  3: engine of worker {wid} killed; with max_migrations = 0, {n}/{n} requests "
              f"answered by workers "
              f"{sorted(set(served))} in {elapsed:.1f} s; worker {wid} failures {failures}, "
              f"ejections {ejections}, ejected gauge "
              f"{metric(m, 'kvroute_router_worker_ejected', worker=wid):.0f}; outcomes "
              f"{outcomes(m)}; load back to zero")
    finally:
        procs.stop_all()


def overflow_requests(messages, rendered):
    """The four ways to send an over-long prompt: chat and completion, streamed or not."""
    for name, path, body in [
        ("chat", "/v1/chat/completions", {"model": MODEL, "messages": messages}),
        ("chat stream", "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                "stream": True}),
        ("completion", "/v1/completions", {"model": MODEL, "prompt": rendered}),
        ("completion stream", "/v1/completions", {"model": MODEL, "prompt": rendered,
                                                 "stream": True}),
    ]:
        yield name, path, {**body, "max_tokens": MAX_TOKENS}


def case_context_overflow(env):
    """4. An engine's refusal: a prompt over its context."""
    log_dir = env.case_dir("4-context-overflow")
    small = start_servers(env.model, 1, slots=1, ctx_per_slot=SMALL_CTX, log_dir=log_dir)[0]
    env.extra_servers.append(small)
    procs = CaseProcs(env.binary, log_dir)
    wid = 1
    try:
        n_ctx = http_json(small.url + "/props")["default_generation_settings"]["n_ctx"]
        assert n_ctx == SMALL_CTX, n_ctx
        router = env.router(procs, "overflow", "kv-adaptive", worker_ids=[wid])
        env.sidecar(procs, router, small, wid)
        router.wait_for_workers([wid])

        def prompt(items):
            text = " ".join(f"cache block token prefix router number {i}." for i in range(items))
            messages = [{"role": "user", "content": text}]
            rendered = http_json(small.url + "/apply-template", {"messages": messages})["prompt"]
            tokens = http_json(small.url + "/tokenize", {"content": rendered})["tokens"]
            return messages, rendered, tokens

        def refused(messages, rendered, tokens, context):
            # The engine itself refuses it (so the case is real, whoever answers first).
            status, body = post_raw(small.url + "/completion", {"prompt": tokens, "n_predict": 4})
            assert status == 400 and body["error"]["type"] == "exceed_context_size_error", \
                (status, body)
            answers = {}
            for name, path, body in overflow_requests(messages, rendered):
                status, answer = router.post(path, body)
                error = answer.get("error") if isinstance(answer, dict) else None
                assert status == 400 and error and \
                    error.get("code") == "context_length_exceeded", \
                    f"{name}: a {len(tokens)}-token prompt over a {context}-token context got " \
                    f"{status} {answer!r}; expected 400 `context_length_exceeded`"
                assert error.get("message"), f"{name}: no message in {answer!r}"
                answers[name] = error["message"]
            return answers

        # The worker learnt the engine's context at start and refuses what cannot fit.
        messages, rendered, tokens = prompt(40)
        answers = refused(messages, rendered, tokens, n_ctx)
        print(f"  4: a {len(tokens)}-token prompt over a {n_ctx}-token context: 400 "
              f"`context_length_exceeded` for {', '.join(answers)} ({answers['chat']!r})")

        # The engine restarted (same port) with a smaller context than the worker learnt: the
        # prompt goes to the engine, whose own 400 must reach the client the same way.
        small.kill()
        small = start_servers(env.model, 1, slots=1, ctx_per_slot=RESTART_CTX,
                              log_dir=os.path.join(log_dir, "restarted"), ports=[small.port])[0]
        env.extra_servers.append(small)
        messages, rendered, tokens = prompt(16)
        assert RESTART_CTX < len(tokens) < n_ctx, len(tokens)
        answers = refused(messages, rendered, tokens, RESTART_CTX)
        print(f"  4: the engine restarted with a {RESTART_CTX}-token context (the worker still "
              f"holds {n_ctx}): a {len(tokens)}-token prompt got 400 `context_length_exceeded` "
              f"for {', '.join(answers)} ({answers['chat']!r})")

        m = router.metrics()
        rejected = outcomes(m).get("rejected", 0)
        assert rejected >= 8, f"outcomes {outcomes(m)}: expected 8 rejected"
        assert not failures_of(m, wid) and not ejections_of(m, wid), \
            f"a refusal counted against the worker: failures {failures_of(m, wid)}, " \
            f"ejections {ejections_of(m, wid)}"
        assert router.chat_ok("fits") == wid
        router.assert_idle([wid])
        print(f"  4: outcomes {outcomes(m)}; no failure or ejection; a prompt that fits is served")
    finally:
        procs.stop_all()
        small.stop()


def case_wrong_dialect(env):
    """5. `--engine sglang` pointed at llama.cpp."""
    log_dir = env.case_dir("5-wrong-dialect")
    url = env.servers[0].url
    text, code, took = run_refused(env.binary, log_dir, "worker-sglang", [
        "worker", "--engine", "sglang", "--engine-url", url, "--id", "50", "--engine-wait", "10s"])
    assert "answers like llamacpp" in text, \
        f"the worker exited {code} without saying the engine answers like llamacpp:\n{text[-3000:]}"
    print(f"  5: `kvroute worker --engine sglang` at llama.cpp exited {code} in {took:.1f} s: "
          f"{last_error_line(text)}")
    config = os.path.join(log_dir, "serve-sglang.toml")
    serve_config(config, env.model_dir, "round-robin",
                 fleet_entries([env.servers[0]], [51], engine="sglang"))
    text, code, took = run_refused(env.binary, log_dir, "serve-sglang", ["serve", "--config", config])
    assert "answers like llamacpp" in text, \
        f"kvroute serve exited {code} without saying the engine answers like llamacpp:\n{text[-3000:]}"
    print(f"  5: `kvroute serve` with a fleet entry engine = \"sglang\" at llama.cpp exited {code} "
          f"in {took:.1f} s")


def case_refused_configs(env):
    """6. A static fleet of engines without a tokenizer; a fleet block size not the router's."""
    log_dir = env.case_dir("6-refused-configs")
    config = os.path.join(log_dir, "serve-no-tokenizer.toml")
    with open(config, "w") as f:
        f.write("[http]\nlisten = \"127.0.0.1:0\"\n\n[router]\nblock_size = 16\n\n[discovery]\n"
                + fleet_entries([env.servers[0]], [61]))
    text, code, took = run_refused(env.binary, log_dir, "serve-no-tokenizer",
                                   ["serve", "--config", config])
    assert "--model NAME,tokenizer=" in text, \
        f"kvroute serve exited {code} without naming --model NAME,tokenizer=:\n{text[-3000:]}"
    print(f"  6: a static fleet of engines without a tokenizer: exit {code} in {took:.1f} s: "
          f"{last_error_line(text)}")
    config = os.path.join(log_dir, "serve-block-size.toml")
    serve_config(config, env.model_dir, "round-robin",
                 fleet_entries([env.servers[0]], [62], block_size=2 * BLOCK_SIZE))
    text, code, took = run_refused(env.binary, log_dir, "serve-block-size",
                                   ["serve", "--config", config])
    assert "differs from the router's block size" in text, \
        f"kvroute serve exited {code} without naming the block size mismatch:\n{text[-3000:]}"
    print(f"  6: a fleet entry with kv_block_size {2 * BLOCK_SIZE} (router {BLOCK_SIZE}): exit "
          f"{code} in {took:.1f} s")


def last_error_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    line = (errors or lines or [""])[-1]
    return line if len(line) <= 300 else line[:300] + "..."


def case_restart(env):
    """7. An engine killed and restarted on its port behind its sidecar, under traffic."""
    procs = CaseProcs(env.binary, env.case_dir("7-restart"))
    ids = [s.index + 1 for s in env.servers]
    stop = threading.Event()
    records, errors = [], []
    try:
        router = env.router(procs, "restart", "round-robin", worker_ids=ids)
        for s, i in zip(env.servers, ids):
            env.sidecar(procs, router, s, i)
        router.wait_for_workers(ids)

        def traffic():
            n = 0
            while not stop.is_set():
                t = time.monotonic()
                try:
                    records.append((t, router.chat_ok(f"traffic {n}")))
                except Exception as e:  # noqa: BLE001 - every failure is reported below
                    errors.append((t, repr(e)))
                n += 1

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        wait_for("traffic to flow", lambda: len(records) >= 6 or errors)
        index = 1
        victim, wid = env.servers[index], ids[index]
        t_kill = time.monotonic()
        victim.kill()
        time.sleep(1.0)  # requests keep coming while the engine is down
        t_restart = time.monotonic()
        restarted = start_servers(env.model, 1, log_dir=os.path.join(procs.log_dir, "restarted"),
                                  ports=[victim.port], **ENGINE)[0]
        restarted.index = victim.index
        env.servers[index] = restarted
        t_up = time.monotonic()
        wait_for(f"worker {wid} to serve again after its engine restarted",
                 lambda: errors or any(t > t_up and w == wid for t, w in records),
                 timeout=RECOVERY_TIMEOUT)
        stop.set()
        thread.join(timeout=STEP_TIMEOUT * 2)
        assert not thread.is_alive(), "the traffic thread did not stop"
        assert not errors, f"{len(errors)} requests failed around the restart: {errors[:3]}"
        during = [w for t, w in records if t_kill <= t < t_restart]
        assert during, "no request was sent while the engine was down"
        assert wid not in during, f"worker {wid} answered while its engine was down: {during}"
        m = router.metrics()
        router.assert_idle(ids)
        print(f"  7: engine of worker {wid} killed and restarted on port {restarted.port} "
              f"{t_up - t_kill:.1f} s later; {len(records)} requests, all answered ({len(during)} "
              f"while it was down); worker {wid} served again; failures {failures_of(m, wid)}, "
              f"ejections {ejections_of(m, wid)}; load back to zero")
    finally:
        stop.set()
        procs.stop_all()


CASES = {
    5: case_wrong_dialect,
    6: case_refused_configs,
    4: case_context_overflow,
    1: case_first_byte_timeout,
    2: case_idle_timeout,
    7: case_restart,
    3: case_static_fleet_dead_engine,  # last: it kills a server for good
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kvroute", help="the kvroute binary")
    parser.add_argument("--cases", default=",".join(str(c) for c in sorted(CASES)),
                        help="comma-separated case numbers (default: all)")
    args = parser.parse_args()
    if not os.path.exists(args.kvroute):
        raise SystemExit(f"kvroute binary not found at {args.kvroute}")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("the `openai` package is missing: pip install -r tests/python/requirements.txt")
    wanted = {int(c) for c in args.cases.split(",") if c}
    unknown = wanted - set(CASES)
    if unknown:
        parser.error(f"no case {sorted(unknown)}; cases are {sorted(CASES)}")
    # SIGTERM (a harness stopping the run) unwinds through the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("faults.py: terminated"))
    log_dir = os.environ.get("KVROUTE_E2E_LOGS") or tempfile.mkdtemp(prefix="kvroute-llamacpp-faults-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"logs in {log_dir}")
    started = time.monotonic()
    model_dir = os.path.join(log_dir, "model")
    subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), model_dir, "--seed", "0"],
                   check=True, timeout=STEP_TIMEOUT)
    env = Env(args.kvroute, log_dir, model_dir)
    try:
        env.start_servers()
        print("llama.cpp servers: " + ", ".join(s.url for s in env.servers))
        for number, case in CASES.items():
            if number not in wanted:
                continue
            t0 = time.monotonic()
            print(f"case {number}: {case.__doc__.split('. ', 1)[1]}", flush=True)
            case(env)
            print(f"case {number} OK in {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        env.cleanup()
    print(f"llama.cpp faults OK in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
