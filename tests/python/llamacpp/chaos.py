#!/usr/bin/env python3
"""Chaos soak: two kvroute routers over NATS in front of real llama.cpp engines and mock workers,
under multi-turn chat load, while a seeded schedule kills, freezes and restarts the pieces.

Usage: python3 chaos.py KVROUTE_BINARY [--minutes N] [--seed S] [--log-dir DIR]
                        [--engines E] [--clients C]

(`cargo xtask soak chaos [--minutes N] [--seed S]` builds kvroute in release mode and runs this.)

The fleet, all on 127.0.0.1 and all started here:
  * a private `nats-server -js` (a free port, a temporary store directory);
  * E (default 3) tiny llama.cpp servers (servers.py; one slot each, `--slot-prompt-similarity 0`,
    `--metrics`) on fixed ports, each behind a sidecar `kvroute worker --engine llamacpp --nats URL
    --id I --first-byte-timeout 5s --idle-timeout 5s` (ids 1..E);
  * two mock workers `kvroute worker --mock --nats URL --id 10I --speedup 10` (ids 101, 102);
  * two routers `kvroute serve --nats URL --listen 127.0.0.1:PORT --model tiny,tokenizer=...,
    chat_template=...` on fixed ports.

The load: C (default 6) clients, each running seeded multi-turn conversations (3 to 6 turns) over
four shared system prompts through the stock `openai` client, streamed or not, every turn sent to
a router chosen by the seed. Every request is bounded (60 s per read, 90 s in all). A request whose
router is down (connection refused) or was killed under it (its stream cut) is retried once on the
other router, as a load balancer in front of the two would.

The faults: none for the first 60-90 s (the baseline), then one every 30-60 s, of a kind drawn
from a seeded shuffle of all kinds (each kind once before any repeats):
  engine-kill-fast  SIGKILL an engine, restart it on its port after 1 s
  engine-kill-slow  the same, restarted after 10 s
  engine-freeze     SIGSTOP an engine for 8 s, then SIGCONT
  router-kill       SIGKILL a router, restart it on its port after 3 s
  mock-kill         SIGKILL a mock worker, restart it with its id after 1 s
  nats-restart      SIGKILL nats-server, restart it on its port and store after 5 s
No fault starts unless it has recovered at least 20 s before the load ends.

Every request gets exactly one outcome: `completed` (200 and a finished answer: a finish reason
and usage), `completed-after-retry`, `clear-error` (an HTTP error status with an OpenAI error body,
or a stream ended by an OpenAI error event) or `LOST` (anything else: an exception without a
status, a stream cut without an error, a timeout). One JSON line per request goes to
LOG_DIR/requests.jsonl, one per fault to LOG_DIR/faults.jsonl, a progress line to stdout every 30 s.

Hit rate: the engines' own `usage.prompt_tokens_details.cached_tokens` over `prompt_tokens` of the
completed requests, in the fault-free baseline window (from 30 s to the first fault) and in the
window 10-40 s after each fault recovered (cut at the next fault); the aim is within 5 points of
the baseline (reported, never failed on). Routers' VmRSS is sampled every 2 s, per incarnation.

At the end the load stops, every router's load gauges must return to zero within 30 s
(`kvroute_router_worker_active_requests`, `_prefill_tokens`, `_active_blocks`,
`_reported_requests`, `kvroute_router_replica_remote_requests`), and the script exits 1 if any
request was LOST, fewer than 99% completed, the load did not return to zero, a process exited
without being killed, or a killed process failed to start again (a restart is retried every
second for 30 s, as a supervisor would, and every failed attempt is reported with its log).
Every process is stopped on any exit, Ctrl-C included (kvroute and nats-server also die with this
script: PR_SET_PDEATHSIG; the engines exit when its pipes close). Exit 2: the fleet could not be
set up; 130: interrupted.
"""

import argparse
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree when importing

from servers import start_servers  # noqa: E402

MODEL = "tiny"
ENGINE = dict(slots=1, ctx_per_slot=4096, slot_similarity=0.0)  # as e2e.py: a prefix cache
MOCK_IDS = (101, 102)
N_ROUTERS = 2
READY_TIMEOUT = 30.0  # a process must print its readiness line within this
REQUEST_TIMEOUT = 60.0  # the openai client's timeout (each read)
REQUEST_DEADLINE = 90.0  # a request's whole life, retry included
IDLE_TIMEOUT = 30.0  # the load's gauges must read zero within this after it stops
PROGRESS_EVERY = 30.0
RSS_EVERY = 2.0
BASELINE_START = 30.0  # the caches warm up before this
FIRST_FAULT = (60.0, 90.0)
FAULT_GAP = (30.0, 60.0)
SETTLE = 10.0  # a fault's hit-rate window starts this long after it recovered ...
WINDOW = 30.0  # ... and lasts this long (cut at the next fault)
TAIL = 20.0  # no fault may recover later than this before the load ends
MIN_WINDOW = 10.0  # shorter hit-rate windows are reported as too short
MIN_COMPLETED = 0.99
HIT_RATE_TOLERANCE = 0.05
GAUGES = ("kvroute_router_worker_active_requests", "kvroute_router_worker_prefill_tokens",
          "kvroute_router_worker_active_blocks", "kvroute_router_worker_reported_requests",
          "kvroute_router_replica_remote_requests")

FAULTS = {  # kind: seconds until it is undone
    "engine-kill-fast": 1.0,
    "engine-kill-slow": 10.0,
    "engine-freeze": 8.0,
    "router-kill": 3.0,
    "mock-kill": 1.0,
    "nats-restart": 5.0,
}

WORDS = (
    "cache block token prefix router worker engine slot prompt stream request reply model "
    "system user turn answer family memory queue load metric latency batch decode prefill "
    "the a of to and in is it that on for with as by at from this be are was an or"
).split()

OUTCOMES = ("completed", "completed-after-retry", "clear-error", "LOST")


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def http_text(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(metrics, name):
    """(labels, value) of every sample of `name` in Prometheus text."""
    out = []
    for line in metrics.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        labels = {}
        if rest.startswith("{"):
            inside, rest = rest[1:].split("}", 1)
            for pair in inside.split(","):
                if "=" in pair:
                    k, v = pair.split("=", 1)
                    labels[k] = v.strip('"')
        elif not rest.startswith(" "):
            continue  # another metric with this prefix
        out.append((labels, float(rest.split()[0])))
    return out


def log(t0, message):
    print(f"[{time.monotonic() - t0:7.1f}s] {message}", flush=True)


# --- Processes ---

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# Resumes an engine that this script froze if the script dies before it resumes it (a stopped
# process never reads that its standard input closed): the guard's own stdin closes either way.
THAW_GUARD = """
import os, signal, sys
sys.stdin.read()
try:
    os.kill(int(sys.argv[1]), signal.SIGCONT)
except OSError:
    pass
"""


def spawn(args, log_path):
    """A child that gets SIGKILL when this script dies, in a session of its own (so a terminal's
    Ctrl-C reaches only this script, which stops everything in order). Spawned from the main
    thread only: the death signal follows the thread that forked."""
    assert threading.current_thread() is threading.main_thread()
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(log_path, "w"),
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                            preexec_fn=_die_with_parent,
                            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})


def read_ready(proc, log_path, what):
    """Waits for the first stdout line (the readiness line), then keeps draining stdout."""
    line = {}

    def read():
        line["text"] = proc.stdout.readline()
        for _ in proc.stdout:
            pass

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT
    while not line.get("text"):
        if time.monotonic() > deadline or proc.poll() is not None or line.get("text") == "":
            tail = open(log_path, errors="replace").read()[-3000:]
            raise RuntimeError(f"{what} printed no readiness line (exit {proc.poll()}); "
                               f"{log_path} ends with:\n{tail}")
        time.sleep(0.02)
    return line["text"]


def stop_proc(proc, timeout=5.0):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
    except OSError:
        pass


class Fleet:
    """Every process of the run, by role, with the incarnation of each."""

    def __init__(self, binary, log_dir, model_dir, seed, n_engines):
        self.binary, self.log_dir, self.model_dir, self.seed = binary, log_dir, model_dir, seed
        self.model = os.path.join(model_dir, "model.gguf")
        self.nats_port = free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.nats_store = os.path.join(log_dir, "nats-store")
        self.nats = None
        self.nats_incarnation = 0
        self.engine_ports = [free_port() for _ in range(n_engines)]
        self.engines = [None] * n_engines  # LlamaServer
        self.engine_incarnation = [0] * n_engines
        self.sidecars = [None] * n_engines
        self.mocks = {i: None for i in MOCK_IDS}
        self.mock_incarnation = {i: 0 for i in MOCK_IDS}
        self.router_ports = [free_port() for _ in range(N_ROUTERS)]
        self.routers = [None] * N_ROUTERS
        self.router_incarnation = [0] * N_ROUTERS
        self.router_down = [False] * N_ROUTERS
        self.rss = []  # one record per router incarnation
        self.rss_lock = threading.Lock()
        self.killed = set()  # pids this script killed or stopped on purpose
        self.unexpected = []  # (time, what, exit code) of processes that died unasked
        self.refused = []  # (time, what, error) of restarts that failed (then tried again)
        self.frozen = {}  # engine index -> guard

    def path(self, name):
        return os.path.join(self.log_dir, name)

    def worker_ids(self):
        return [i + 1 for i in range(len(self.engines))] + list(MOCK_IDS)

    # NATS
    def start_nats(self):
        self.nats_incarnation += 1
        log_path = self.path(f"nats.{self.nats_incarnation}.log")
        self.nats = spawn(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.nats_port),
                           "-sd", self.nats_store], log_path)
        deadline = time.monotonic() + READY_TIMEOUT
        while not port_open(self.nats_port):
            if time.monotonic() > deadline or self.nats.poll() is not None:
                raise RuntimeError(f"nats-server did not start; see {log_path}")
            time.sleep(0.05)

    def kill_nats(self):
        self.killed.add(self.nats.pid)
        self.nats.kill()
        self.nats.wait(timeout=10)

    # Engines and their sidecars
    def start_engine(self, i):
        self.engine_incarnation[i] += 1
        log_dir = self.path(f"engine-{i}.{self.engine_incarnation[i]}")
        deadline = time.monotonic() + READY_TIMEOUT
        while True:  # the port may take a moment to be free again after a kill
            try:
                self.engines[i] = start_servers(self.model, 1, log_dir=log_dir,
                                                ports=[self.engine_ports[i]], **ENGINE)[0]
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def kill_engine(self, i):
        self.killed.add(self.engines[i].proc.pid)
        self.engines[i].kill()

    def freeze_engine(self, i):
        pid = self.engines[i].proc.pid
        guard = subprocess.Popen([sys.executable, "-c", THAW_GUARD, str(pid)],
                                 stdin=subprocess.PIPE)
        self.frozen[i] = guard
        os.kill(pid, signal.SIGSTOP)

    def thaw_engine(self, i):
        guard = self.frozen.pop(i)
        try:
            os.kill(self.engines[i].proc.pid, signal.SIGCONT)
        except OSError:
            pass
        guard.stdin.close()
        guard.wait(timeout=10)

    def start_sidecar(self, i):
        wid = i + 1
        log_path = self.path(f"worker-{wid}.log")
        proc = spawn([self.binary, "worker", "--engine", "llamacpp", "--engine-url",
                      f"http://127.0.0.1:{self.engine_ports[i]}", "--nats", self.nats_url,
                      "--id", str(wid), "--first-byte-timeout", "5s", "--idle-timeout", "5s"],
                     log_path)
        read_ready(proc, log_path, f"sidecar {wid}")
        self.sidecars[i] = proc

    # Mock workers
    def start_mock(self, wid):
        self.mock_incarnation[wid] += 1
        log_path = self.path(f"worker-{wid}.{self.mock_incarnation[wid]}.log")
        proc = spawn([self.binary, "worker", "--mock", "--nats", self.nats_url, "--id", str(wid),
                      "--speedup", "10"], log_path)
        read_ready(proc, log_path, f"mock worker {wid}")
        self.mocks[wid] = proc

    def kill_mock(self, wid):
        self.killed.add(self.mocks[wid].pid)
        self.mocks[wid].kill()
        self.mocks[wid].wait(timeout=10)

    # Routers
    def start_router(self, r, t0):
        self.router_incarnation[r] += 1
        log_path = self.path(f"router-{r}.{self.router_incarnation[r]}.log")
        model = (f"{MODEL},tokenizer={os.path.join(self.model_dir, 'tokenizer.json')},"
                 f"chat_template={os.path.join(self.model_dir, 'template.jinja')}")
        proc = spawn([self.binary, "serve", "--nats", self.nats_url, "--listen",
                      f"127.0.0.1:{self.router_ports[r]}", "--model", model,
                      "--seed", str(self.seed + r)], log_path)
        read_ready(proc, log_path, f"router {r}")
        self.routers[r] = proc
        with self.rss_lock:
            self.rss.append({"router": r, "incarnation": self.router_incarnation[r],
                             "pid": proc.pid, "proc": proc, "started": time.monotonic() - t0,
                             "start": None, "peak": None, "end": None})
        self.router_down[r] = False

    def kill_router(self, r):
        self.router_down[r] = True  # before the kill: a client that sees it die retries
        self.killed.add(self.routers[r].pid)
        self.routers[r].kill()
        self.routers[r].wait(timeout=10)

    def router_url(self, r):
        return f"http://127.0.0.1:{self.router_ports[r]}"

    def metrics(self, r):
        return http_text(self.router_url(r) + "/metrics")

    def sample_rss(self):
        with self.rss_lock:
            records = [rec for rec in self.rss if rec["proc"].poll() is None]
        for rec in records:
            try:
                with open(f"/proc/{rec['pid']}/status") as f:
                    kib = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
            except (OSError, StopIteration, ValueError):
                continue
            with self.rss_lock:
                rec["start"] = kib if rec["start"] is None else rec["start"]
                rec["peak"] = max(rec["peak"] or 0, kib)
                rec["end"] = kib

    def current_rss(self, r):
        with self.rss_lock:
            live = [rec for rec in self.rss if rec["router"] == r and rec["proc"].poll() is None]
        return live[-1]["end"] if live and live[-1]["end"] else None

    def check_unexpected(self, t0):
        """Records kvroute and nats processes that exited without being killed here."""
        procs = [("nats-server", self.nats)] + [
            (f"router {r}", p) for r, p in enumerate(self.routers)] + [
            (f"sidecar {i + 1}", p) for i, p in enumerate(self.sidecars)] + [
            (f"mock worker {w}", p) for w, p in self.mocks.items()] + [
            (f"engine {i}", e.proc if e else None) for i, e in enumerate(self.engines)]
        for what, p in procs:
            if p is not None and p.poll() is not None and p.pid not in self.killed:
                self.killed.add(p.pid)  # reported once
                self.unexpected.append((time.monotonic() - t0, what, p.returncode))
                log(t0, f"UNEXPECTED: {what} (pid {p.pid}) exited with {p.returncode}")

    def restart(self, what, start, t0):
        """Restarts a killed process as a supervisor would (systemd, Kubernetes): when the new
        process fails to start, the failure is recorded (the run fails on it) and the start is
        tried again every second for up to READY_TIMEOUT."""
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                start()
                return
            except RuntimeError as e:
                first = str(e).strip().splitlines()
                last = first[-1] if first else ""
                self.refused.append((time.monotonic() - t0, what, f"{first[0]} ... {last}"))
                log(t0, f"RESTART FAILED: {what}: {first[0]}\n    {last}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def stop_all(self):
        for i in list(self.frozen):
            try:
                self.thaw_engine(i)
            except Exception:  # noqa: BLE001 - cleanup goes on
                pass
        for p in self.routers + list(self.mocks.values()) + self.sidecars:
            stop_proc(p)
        for e in self.engines:
            if e is not None:
                try:
                    e.stop()
                except Exception:  # noqa: BLE001
                    pass
        stop_proc(self.nats)


# --- The load ---

class Workload:
    def __init__(self, seed):
        rng = random.Random(f"kvroute-chaos-{seed}-families")
        self.systems = [f"You are assistant {f} of the chaos soak. " +
                        " ".join(text(rng, 12) for _ in range(25)) for f in range(4)]


class Stats:
    """Every request's record, written as JSON lines, and the counts."""

    def __init__(self, path, t0):
        self.file = open(path, "w")
        self.lock = threading.Lock()
        self.records = []
        self.t0 = t0
        self.in_flight = {}  # client -> (start time, router, conversation, turn)
        self.script_errors = []  # exceptions of this script's own client code

    def add(self, rec):
        with self.lock:
            self.records.append(rec)
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def counts(self):
        with self.lock:
            counts = {o: 0 for o in OUTCOMES}
            for r in self.records:
                counts[r["outcome"]] += 1
            return counts

    def hit_rate(self, start, end, workers=None):
        """Engine-reported hit rate of the requests completed that started in [start, end)
        (served by `workers` when given)."""
        with self.lock:
            done = [r for r in self.records if r["outcome"].startswith("completed")
                    and r["cached_tokens"] is not None and start <= r["t"] < end
                    and (workers is None or r["worker"] in workers)]
        prompt = sum(r["prompt_tokens"] for r in done)
        if not prompt:
            return None, len(done)
        return sum(r["cached_tokens"] for r in done) / prompt, len(done)


class Lost(Exception):
    pass


class ClearError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status, self.message = status, message


class Client:
    """One simulated user: conversation after conversation, every turn to a seeded router."""

    def __init__(self, index, fleet, workload, stats, seed, stop):
        import openai

        self.openai = openai
        self.index, self.fleet, self.workload, self.stats, self.stop = \
            index, fleet, workload, stats, stop
        self.rng = random.Random(f"kvroute-chaos-{seed}-client-{index}")
        self.clients = {}  # router -> (incarnation, openai client)
        self.conversations = 0

    def client(self, r):
        """An OpenAI client per router incarnation: a restarted router gets fresh connections,
        as it would behind a load balancer."""
        inc = self.fleet.router_incarnation[r]
        known = self.clients.get(r)
        if known is None or known[0] != inc:
            if known is not None:
                known[1].close()
            c = self.openai.OpenAI(base_url=self.fleet.router_url(r) + "/v1", api_key="unused",
                                   timeout=REQUEST_TIMEOUT, max_retries=0)
            self.clients[r] = known = (inc, c)
        return known[1]

    def run(self):
        while not self.stop.is_set():
            try:
                self.conversation()
            except Exception as e:  # noqa: BLE001 - a bug here, not in kvroute: said, and failed on
                self.stats.script_errors.append(f"client {self.index}: {type(e).__name__}: {e}")
                print(f"SCRIPT ERROR in client {self.index}: {e!r}", flush=True)
                self.stop.wait(1.0)

    def conversation(self):
        rng = self.rng
        cid = f"c{self.index}-{self.conversations}"
        self.conversations += 1
        family = rng.randrange(len(self.workload.systems))
        messages = [{"role": "system", "content": self.workload.systems[family]}]
        for turn in range(rng.randint(3, 6)):
            if self.stop.is_set():
                return
            messages.append({"role": "user",
                             "content": " ".join(text(rng, 10) for _ in range(rng.randint(4, 8)))})
            router = rng.randrange(N_ROUTERS)
            stream = rng.random() < 0.5
            max_tokens = rng.randint(8, 32)
            rec = self.request(cid, family, turn, router, messages, stream, max_tokens)
            if not rec["outcome"].startswith("completed"):
                return  # a new conversation
            messages.append({"role": "assistant", "content": rec.pop("_reply")})
            self.stop.wait(rng.uniform(0.2, 0.8))

    def request(self, cid, family, turn, router, messages, stream, max_tokens):
        t_start = time.monotonic()
        rec = {"t": round(t_start - self.stats.t0, 3), "ts": round(time.time(), 3),
               "client": self.index, "conversation": cid, "family": family, "turn": turn,
               "router": router, "stream": stream, "max_tokens": max_tokens, "retried": False,
               "outcome": None, "status": None, "cached_tokens": None, "prompt_tokens": None,
               "completion_tokens": None, "worker": None, "latency": None, "error": None}
        self.stats.in_flight[self.index] = (rec["t"], router, cid, turn)
        try:
            for attempt in range(2):
                inc = self.fleet.router_incarnation[router]
                try:
                    reply, usage, worker = self.send(router, messages, stream, max_tokens,
                                                     t_start)
                    rec.update(outcome="completed-after-retry" if attempt else "completed",
                               status=200, worker=worker, _reply=reply, **usage)
                    break
                except ClearError as e:
                    rec.update(outcome="clear-error", status=e.status, error=e.message)
                    break
                except Lost as e:
                    died = (self.fleet.router_down[router]
                            or self.fleet.router_incarnation[router] != inc)
                    if attempt == 0 and died and not e.args[0].startswith("timeout"):
                        rec["error"] = f"router {router} down: {e}"
                        rec["retried"] = True
                        router = 1 - router
                        rec["router"] = router
                        rec["first_router"] = 1 - router
                        continue
                    rec.update(outcome="LOST", error=(rec["error"] + "; then " if rec["error"]
                                                      else "") + str(e))
                    break
        finally:
            self.stats.in_flight.pop(self.index, None)
        rec["latency"] = round(time.monotonic() - t_start, 3)
        reply = rec.pop("_reply", None)
        self.stats.add(rec)
        rec["_reply"] = reply
        return rec

    def send(self, router, messages, stream, max_tokens, t_start):
        """One attempt: (reply text, usage fields, worker), or ClearError / Lost."""
        openai = self.openai
        client = self.client(router)
        extra = {"nvext": {"extra_fields": ["worker_id"]}}
        try:
            if not stream:
                reply = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
                    extra_body=extra)
                choice = reply.choices[0] if reply.choices else None
                if choice is None or not choice.finish_reason or reply.usage is None:
                    raise Lost(f"unfinished answer: {reply}")
                nvext = (reply.model_extra or {}).get("nvext") or {}
                worker = (nvext.get("worker_id") or {}).get("decode_worker_id")
                return choice.message.content or "", usage_fields(reply.usage), worker
            chunks = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body=extra)
            content, finish, usage, worker = [], None, None, None
            try:
                for chunk in chunks:
                    if time.monotonic() - t_start > REQUEST_DEADLINE:
                        raise Lost(f"timeout: the stream ran over {REQUEST_DEADLINE:.0f} s")
                    if chunk.usage:
                        usage = chunk.usage
                    nvext = (chunk.model_extra or {}).get("nvext") or {}
                    worker = (nvext.get("worker_id") or {}).get("decode_worker_id", worker)
                    for choice in chunk.choices:
                        if choice.delta and choice.delta.content:
                            content.append(choice.delta.content)
                        finish = choice.finish_reason or finish
            finally:
                chunks.close()
            if finish is None or usage is None:
                raise Lost(f"the stream ended without "
                           f"{'a finish reason' if finish is None else 'usage'} after "
                           f"{len(content)} content chunks")
            return "".join(content), usage_fields(usage), worker
        except openai.APITimeoutError as e:
            raise Lost(f"timeout: {e!r}") from None
        except openai.APIStatusError as e:
            try:
                body = e.response.json()
            except Exception:  # noqa: BLE001
                body = None
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict) and error.get("message"):
                raise ClearError(e.status_code, f"{error.get('code') or error.get('type')}: "
                                                f"{error['message']}") from None
            raise Lost(f"status {e.status_code} without an OpenAI error body: "
                       f"{e.response.text[:300]!r}") from None
        except openai.APIConnectionError as e:
            raise Lost(f"connection: {e!r} ({e.__cause__!r})") from None
        except openai.APIError as e:  # an error event ending a stream
            if isinstance(e.body, dict) and e.body.get("message"):
                raise ClearError("stream-error", f"{e.body.get('code') or e.body.get('type')}: "
                                                 f"{e.body['message']}") from None
            raise Lost(f"stream error without an OpenAI error body: {e!r}") from None
        except Lost:
            raise
        except Exception as e:  # noqa: BLE001 - anything else is a lost request, named
            raise Lost(f"{type(e).__name__}: {e}") from None


def usage_fields(usage):
    details = usage.prompt_tokens_details
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": details.cached_tokens if details is not None else None}


# --- The fault schedule ---

def schedule(seed, load_seconds, n_engines):
    """[(time, kind, target)], seeded: the first after 60-90 s, then one every 30-60 s, kinds in
    shuffled rounds; none that would recover within TAIL of the load's end."""
    rng = random.Random(f"kvroute-chaos-{seed}-faults")
    faults, kinds = [], []
    t = rng.uniform(*FIRST_FAULT)
    while True:
        if not kinds:
            kinds = list(FAULTS)
            rng.shuffle(kinds)
        kind = kinds[0]
        if t + FAULTS[kind] + TAIL > load_seconds:
            break
        kinds.pop(0)
        if kind.startswith("engine"):
            target = rng.randrange(n_engines)
        elif kind == "router-kill":
            target = rng.randrange(N_ROUTERS)
        elif kind == "mock-kill":
            target = rng.choice(MOCK_IDS)
        else:
            target = None
        faults.append((t, kind, target))
        t += rng.uniform(*FAULT_GAP)
    return faults


def describe(kind, target):
    if kind.startswith("engine"):
        return f"{kind} engine {target} (worker {target + 1})"
    if kind == "router-kill":
        return f"{kind} router {target}"
    if kind == "mock-kill":
        return f"{kind} worker {target}"
    return kind


def inject(fleet, kind, target, t0):
    """Starts a fault; returns the function that undoes it."""
    if kind.startswith("engine-kill"):
        fleet.kill_engine(target)
        return lambda: fleet.restart(f"engine {target}", lambda: fleet.start_engine(target), t0)
    if kind == "engine-freeze":
        fleet.freeze_engine(target)
        return lambda: fleet.thaw_engine(target)
    if kind == "router-kill":
        fleet.sample_rss()  # the incarnation's last figure
        fleet.kill_router(target)
        return lambda: fleet.restart(f"router {target}", lambda: fleet.start_router(target, t0),
                                     t0)
    if kind == "mock-kill":
        fleet.kill_mock(target)
        return lambda: fleet.restart(f"mock worker {target}", lambda: fleet.start_mock(target),
                                     t0)
    if kind == "nats-restart":
        fleet.kill_nats()
        return lambda: fleet.restart("nats-server", fleet.start_nats, t0)
    raise ValueError(kind)


# --- Checks and reports ---

def wait_for_workers(fleet, t0):
    want = set(fleet.worker_ids())
    deadline = time.monotonic() + READY_TIMEOUT
    for r in range(N_ROUTERS):
        while True:
            try:
                listed = {int(l["worker"]) for l, _ in
                          samples(fleet.metrics(r), "kvroute_router_worker_active_requests")
                          if "worker" in l}
            except OSError:
                listed = set()
            if want <= listed:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {r} lists workers {sorted(listed)}, "
                                   f"not all of {sorted(want)}")
            time.sleep(0.2)
    log(t0, f"both routers list workers {sorted(want)}")


def load_left(fleet, r):
    """The nonzero load gauges of router r: [(sample, value)]."""
    out = []
    m = fleet.metrics(r)
    if not samples(m, GAUGES[0]):  # a check that finds nothing to check is no check
        out.append((f"no {GAUGES[0]} samples at all", 1.0))
    for name in GAUGES:
        for labels, v in samples(m, name):
            if v != 0.0:
                out.append((name + "{" + ",".join(f'{k}="{x}"' for k, x in labels.items()) + "}",
                            v))
    return out


def wait_idle(fleet, t0):
    """Waits up to IDLE_TIMEOUT for every router's gauges to read zero; returns what is left."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    while True:
        left = {}
        for r in range(N_ROUTERS):
            try:
                nonzero = load_left(fleet, r)
            except OSError as e:
                nonzero = [(f"/metrics unreadable: {e}", 1.0)]
            if nonzero:
                left[r] = nonzero
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def router_totals(fleet, r):
    m = fleet.metrics(r)
    finished = {l.get("outcome"): v
                for l, v in samples(m, "kvroute_router_requests_finished_total")}
    failures, ejections = {}, {}
    for l, v in samples(m, "kvroute_router_worker_failures_total"):
        failures[l.get("reason")] = failures.get(l.get("reason"), 0) + v
    for l, v in samples(m, "kvroute_router_worker_ejections_total"):
        ejections[l.get("reason")] = ejections.get(l.get("reason"), 0) + v
    resets = sum(v for _, v in samples(m, "kvroute_router_prediction_resets_total"))

    def fmt(d):
        return ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items()) if v) or "none"

    return (f"finished {fmt(finished)}; worker failures {fmt(failures)}; ejections "
            f"{fmt(ejections)}; prediction resets {resets:.0f}")


def mib(kib):
    return "?" if kib is None else f"{kib / 1024:.1f}"


def fmt_rate(rate):
    return "n/a" if rate is None else f"{rate:.3f}"


def progress(fleet, stats, t0, since):
    now = time.monotonic() - t0
    c = stats.counts()
    rate, n = stats.hit_rate(since, now)
    rss = ", ".join(f"router {r} {mib(fleet.current_rss(r))} MiB" for r in range(N_ROUTERS))
    log(t0, f"progress: {sum(c.values())} requests: completed {c['completed']}, after retry "
            f"{c['completed-after-retry']}, clear error {c['clear-error']}, LOST {c['LOST']} | "
            f"hit rate (last {now - since:.0f} s, {n} requests) {fmt_rate(rate)} | RSS {rss}")


# --- Main ---

def run(args, log_dir):
    t0 = time.monotonic()
    load_seconds = args.minutes * 60.0
    model_dir = os.path.join(log_dir, "model")
    subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), model_dir, "--seed",
                    "0"], check=True, stdout=subprocess.DEVNULL)
    fleet = Fleet(args.kvroute, log_dir, model_dir, args.seed, args.engines)
    stats = None
    stop = threading.Event()
    threads = []
    faults_file = open(os.path.join(log_dir, "faults.jsonl"), "w")
    try:
        fleet.start_nats()
        for i in range(args.engines):
            fleet.start_engine(i)
        for i in range(args.engines):
            fleet.start_sidecar(i)
        for wid in MOCK_IDS:
            fleet.start_mock(wid)
        for r in range(N_ROUTERS):
            fleet.start_router(r, t0)
        log(t0, f"nats {fleet.nats_url}; engines on ports {fleet.engine_ports}; routers "
                f"{', '.join(fleet.router_url(r) for r in range(N_ROUTERS))}")
        wait_for_workers(fleet, t0)

        plan = schedule(args.seed, load_seconds, args.engines)
        log(t0, f"load: {args.clients} clients for {args.minutes} min; {len(plan)} faults planned "
                f"at " + ", ".join(f"+{t:.0f}s {k}" for t, k, _ in plan))
        workload = Workload(args.seed)
        t_load = time.monotonic()
        log(t0, "load starts; from here on every time is counted from the start of the load")
        t0 = t_load
        stats = Stats(os.path.join(log_dir, "requests.jsonl"), t_load)
        for c in range(args.clients):
            client = Client(c, fleet, workload, stats, args.seed, stop)
            th = threading.Thread(target=client.run, name=f"client-{c}", daemon=True)
            th.start()
            threads.append(th)

        rss_stop = threading.Event()

        def sample_rss():
            while not rss_stop.wait(RSS_EVERY):
                fleet.sample_rss()

        threading.Thread(target=sample_rss, daemon=True).start()
        fleet.sample_rss()

        tl = lambda: time.monotonic() - t_load  # noqa: E731 - load time
        done_faults = []  # dicts
        pending = list(plan)
        undo = None  # (at, fn, record)
        next_progress = PROGRESS_EVERY
        while tl() < load_seconds:
            now = tl()
            if undo is None and pending and now >= pending[0][0]:
                at, kind, target = pending.pop(0)
                rec = {"kind": kind, "target": target, "at": round(now, 3),
                       "planned": round(at, 3), "recovered": None}
                log(t0, f"FAULT: {describe(kind, target)}")
                fn = inject(fleet, kind, target, t0)
                undo = (now + FAULTS[kind], fn, rec)
            if undo is not None and tl() >= undo[0]:
                _, fn, rec = undo
                try:
                    fn()
                    rec["recovered"] = round(tl(), 3)
                    log(t0, f"recovered: {describe(rec['kind'], rec['target'])} "
                            f"({rec['recovered'] - rec['at']:.1f} s after the fault)")
                except RuntimeError:  # recorded in fleet.refused; the run goes on without it
                    rec["recovered"] = round(tl(), 3)
                    rec["gave_up"] = True
                    log(t0, f"GAVE UP restarting after {describe(rec['kind'], rec['target'])}")
                faults_file.write(json.dumps(rec) + "\n")
                faults_file.flush()
                done_faults.append(rec)
                undo = None
            fleet.check_unexpected(t0)
            if tl() >= next_progress:
                progress(fleet, stats, t0, max(0.0, next_progress - PROGRESS_EVERY))
                next_progress += PROGRESS_EVERY
            time.sleep(0.1)
        if undo is not None:  # cannot happen with the TAIL rule, but never leave a fault behind
            undo[1]()
        log(t0, "load time over: stopping the clients")
        stop.set()
        deadline = time.monotonic() + REQUEST_DEADLINE + 30
        for th in threads:
            th.join(timeout=max(0.1, deadline - time.monotonic()))
        hung = dict(stats.in_flight)
        for c, (t, r, cid, turn) in hung.items():
            stats.add({"t": t, "client": c, "conversation": cid, "turn": turn, "router": r,
                       "outcome": "LOST", "status": None, "cached_tokens": None,
                       "prompt_tokens": None, "error": "hung: no answer when the run ended"})
        left = wait_idle(fleet, t0)
        fleet.check_unexpected(t0)
        fleet.sample_rss()
        rss_stop.set()
        return report(fleet, stats, done_faults, left, load_seconds, log_dir, t0)
    finally:
        stop.set()
        faults_file.close()
        fleet.stop_all()


def report(fleet, stats, faults, left, load_seconds, log_dir, t0):
    c = stats.counts()
    total = sum(c.values())
    completed = c["completed"] + c["completed-after-retry"]
    pct = completed / total if total else 0.0
    accounted = (total - c["LOST"]) / total if total else 0.0
    lines = ["", "=== chaos soak summary ===",
             f"requests {total}: completed {c['completed']}, completed after retry "
             f"{c['completed-after-retry']}, clear error {c['clear-error']}, LOST {c['LOST']}",
             f"completed {pct * 100:.2f}% (at least {MIN_COMPLETED * 100:.0f}% wanted), "
             f"accounted for {accounted * 100:.2f}%"]
    with stats.lock:
        errors = {}
        for r in stats.records:
            if r["outcome"] == "clear-error":
                key = f"{r['status']} {r['error']}"
                errors[key] = errors.get(key, 0) + 1
        lost = [r for r in stats.records if r["outcome"] == "LOST"]
    for key, n in sorted(errors.items(), key=lambda kv: -kv[1]):
        lines.append(f"  clear error x{n}: {key[:200]}")
    first_fault = faults[0]["at"] if faults else load_seconds
    base, n = stats.hit_rate(BASELINE_START, first_fault)
    lines.append(f"hit rate (engine-reported cached / prompt tokens): baseline "
                 f"{fmt_rate(base)} over {n} requests (+{BASELINE_START:.0f}s to "
                 f"+{first_fault:.0f}s, no fault)")
    for i, f in enumerate(faults):
        start = f["recovered"] + SETTLE
        nxt = faults[i + 1]["at"] if i + 1 < len(faults) else load_seconds
        end = min(start + WINDOW, nxt, load_seconds)
        what = f"  after {describe(f['kind'], f['target'])} at +{f['at']:.0f}s:"
        if end - start < MIN_WINDOW:
            lines.append(f"{what} window too short ({max(0.0, end - start):.0f} s)")
            continue
        rate, n = stats.hit_rate(start, end)
        delta = "" if rate is None or base is None else (
            f", {(rate - base) * 100:+.1f} points"
            + ("" if abs(rate - base) <= HIT_RATE_TOLERANCE else
               f" (more than {HIT_RATE_TOLERANCE * 100:.0f} from the baseline)"))
        lines.append(f"{what} {fmt_rate(rate)} over {n} requests (+{start:.0f}s to +{end:.0f}s)"
                     f"{delta}")
    engines = set(range(1, len(fleet.engines) + 1))
    whole = [stats.hit_rate(0.0, load_seconds, w) for w in (None, engines, set(MOCK_IDS))]
    lines.append(f"  whole run: {fmt_rate(whole[0][0])} over {whole[0][1]} requests; llama.cpp "
                 f"engines {fmt_rate(whole[1][0])} ({whole[1][1]}), mock workers "
                 f"{fmt_rate(whole[2][0])} ({whole[2][1]})")
    lines.append("router RSS (MiB) per incarnation, start / peak / end:")
    with fleet.rss_lock:
        for rec in fleet.rss:
            lines.append(f"  router {rec['router']}.{rec['incarnation']} (pid {rec['pid']}, "
                         f"started +{rec['started']:.0f}s): {mib(rec['start'])} / "
                         f"{mib(rec['peak'])} / {mib(rec['end'])}")
    for r in range(N_ROUTERS):
        try:
            lines.append(f"router {r}: {router_totals(fleet, r)}")
        except OSError as e:
            lines.append(f"router {r}: /metrics unreadable: {e}")
    failed = []
    if left:
        failed.append("the load did not return to zero")
        for r, nonzero in left.items():
            lines.append(f"router {r}: load NOT zero {IDLE_TIMEOUT:.0f} s after the load stopped:")
            lines.extend(f"  {name} {v:g}" for name, v in nonzero)
    else:
        lines.append(f"load gauges: zero on both routers after the load stopped "
                     f"({', '.join(GAUGES)})")
    if lost:
        failed.append(f"{len(lost)} requests LOST")
        lines.append("LOST requests (with the last fault before each):")
        for r in lost[:50]:
            before = [f for f in faults if f["at"] <= r["t"] + (r.get("latency") or 0)]
            fault = (f"{describe(before[-1]['kind'], before[-1]['target'])} at "
                     f"+{before[-1]['at']:.1f}s" if before else "no fault before it")
            lines.append(f"  +{r['t']:.1f}s router {r['router']} {r['conversation']} turn "
                         f"{r['turn']} stream={r.get('stream')} latency {r.get('latency')} s: "
                         f"{r['error']} [last fault: {fault}]")
    if total and pct < MIN_COMPLETED:
        failed.append(f"only {pct * 100:.2f}% completed")
    if fleet.refused:
        failed.append("processes failed to restart")
        groups = []  # consecutive failed attempts of one process: [what, first, last, n, error]
        for t, what, error in fleet.refused:
            if groups and groups[-1][0] == what and t - groups[-1][2] < 5.0:
                groups[-1][2:4] = [t, groups[-1][3] + 1]
            else:
                groups.append([what, t, t, 1, error])
        for what, first, last, n, error in groups:
            lines.append(f"RESTART FAILED: {what}, {n} attempts from +{first:.0f}s to "
                         f"+{last:.0f}s; the first: {error}")
    if fleet.unexpected:
        failed.append("processes exited unasked")
        for t, what, code in fleet.unexpected:
            lines.append(f"UNEXPECTED exit: {what} with {code} at +{t:.0f}s")
    if stats.script_errors:
        failed.append("the script's clients failed")
        lines.extend(f"SCRIPT ERROR: {e}" for e in stats.script_errors[:20])
    if not total:
        failed.append("no requests were sent")
    lines.append(f"logs: {log_dir} (requests.jsonl, faults.jsonl, one log per process)")
    lines.append("RESULT: " + ("FAIL: " + "; ".join(failed) if failed else "OK"))
    text_out = "\n".join(lines)
    print(text_out, flush=True)
    with open(os.path.join(log_dir, "summary.txt"), "w") as f:
        f.write(text_out + "\n")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kvroute", help="the kvroute binary (a release build)")
    parser.add_argument("--minutes", type=float, default=5.0, help="load time (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the load and the faults")
    parser.add_argument("--log-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--engines", type=int, default=3, help="llama.cpp engines (default 3)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    args = parser.parse_args()
    if not os.path.exists(args.kvroute):
        raise SystemExit(f"kvroute binary not found at {args.kvroute}")
    if not 0 < args.minutes <= 240:
        raise SystemExit("--minutes: 0 to 240")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("the `openai` package is missing: "
                         "pip install -r tests/python/requirements.txt")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvroute-chaos-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"chaos soak: {args.minutes:g} min, seed {args.seed}; logs in {log_dir}", flush=True)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # even when started with SIGINT ignored (in background)
    try:
        code = run(args, log_dir)
    except KeyboardInterrupt:
        print(f"interrupted; every process stopped; logs in {log_dir}", flush=True)
        code = 130
    except RuntimeError as e:
        print(f"chaos soak could not run: {e}\nlogs in {log_dir}", flush=True)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
