#!/usr/bin/env python3
"""Runs N real llama.cpp HTTP servers on loopback, CPU only, through the `xllamacpp` wheel.

Usage: python3 servers.py MODEL_GGUF [-n N] [--slots S] [--ctx-per-slot C] [--threads T]
                          [--cache-ram-mib M] [--alias NAME] [--log-dir DIR] [--ports P,P,...]

`xllamacpp.Server(CommonParams)` runs llama.cpp's own server (tools/server, the code behind
`llama-server`) on a background thread of the calling process, so each server here is a child
process of its own (a server can then be killed alone, as a crashed engine would be). The options
mirror llama-server's flags: `-c S*C -np S -t T -tb T --host 127.0.0.1 --port 0 --metrics
--slots --cache-prompt --no-warmup --alias NAME` (plus `--cache-ram M` when given; llama.cpp's
default keeps 8 GiB of evicted prompt caches in host memory).

Prints one line per server once all are listening, in index order:
    llamacpp i=0 url=http://127.0.0.1:PORT pid=PID
then runs until its standard input closes or it gets SIGTERM/SIGINT, and stops them all. Each child
also exits when its standard input (a pipe from this process) closes, so none outlives a killed
parent. Every wait is bounded. Starting takes well under a second per server.

Other scripts import `start_servers` (returning `LlamaServer`s with `url`, `proc`, `kill()`) and
`stop_servers` from here. `ports` (`--ports`) gives each server a fixed port instead of a free one,
e.g. to restart a killed server where its clients expect it.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class LlamaServer:
    """One llama.cpp server child process."""

    def __init__(self, index, proc, url, log_path):
        self.index = index
        self.proc = proc
        self.url = url
        self.log_path = log_path

    @property
    def port(self):
        return int(self.url.rsplit(":", 1)[1])

    def kill(self):
        """SIGKILL, as a crash would: no goodbye to the clients."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT)

    def stop(self):
        if self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)


def start_servers(model, n=1, slots=4, ctx_per_slot=4096, threads=1, cache_ram_mib=None,
                  alias="tiny", log_dir=None, kv_unified=False, slot_similarity=None, ports=None):
    """Starts `n` servers in parallel and returns them once every one is listening; server `i`
    listens on `ports[i]` when `ports` is given (0: a free port), else on a free port."""
    if ports is not None and len(ports) != n:
        raise ValueError(f"{len(ports)} ports for {n} servers")
    log_dir = log_dir or os.environ.get("KVROUTE_E2E_LOGS", "/tmp")
    os.makedirs(log_dir, exist_ok=True)
    servers, readers = [], []
    for i in range(n):
        log_path = os.path.join(log_dir, f"llamacpp-{i}.log")
        args = [sys.executable, os.path.abspath(__file__), "--child", model, "--slots", str(slots),
                "--ctx-per-slot", str(ctx_per_slot), "--threads", str(threads), "--alias", alias]
        if cache_ram_mib is not None:
            args += ["--cache-ram-mib", str(cache_ram_mib)]
        if kv_unified:
            args.append("--kv-unified")
        if slot_similarity is not None:
            args += ["--slot-similarity", str(slot_similarity)]
        if ports is not None:
            args += ["--port", str(ports[i])]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(log_path, "w"), text=True)
        line = {}

        def read(proc=proc, line=line):
            line["text"] = proc.stdout.readline()
            for _ in proc.stdout:  # keep draining
                pass

        threading.Thread(target=read, daemon=True).start()
        servers.append((i, proc, log_path))
        readers.append(line)
    deadline = time.monotonic() + READY_TIMEOUT
    started = []
    try:
        for (i, proc, log_path), line in zip(servers, readers):
            while "text" not in line:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"llama.cpp server {i} did not start; see {log_path}")
                time.sleep(0.01)
            fields = dict(w.split("=", 1) for w in line["text"].split() if "=" in w)
            if "url" not in fields:
                raise RuntimeError(f"llama.cpp server {i} printed {line['text']!r}; see {log_path}")
            started.append(LlamaServer(i, proc, fields["url"], log_path))
    except BaseException:
        for _, proc, _ in servers:
            proc.kill()
        raise
    return started


def stop_servers(servers):
    for s in servers:
        s.stop()


def child(args):
    """One server in this process, until stdin closes or SIGTERM."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.model_alias = {args.alias}  # a set of names in this llama.cpp
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.slots
    params.n_ctx = args.slots * args.ctx_per_slot
    params.cache_prompt = True
    if args.cache_ram_mib is not None:
        params.cache_ram_mib = args.cache_ram_mib
    params.kv_unified = args.kv_unified
    if args.slot_similarity is not None:
        params.slot_prompt_similarity = args.slot_similarity
    params.endpoint_slots = True
    params.endpoint_metrics = True
    params.warmup = False
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    server = xllamacpp.Server(params)
    print(f"ready url={server.listening_address}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())

    def wait_stdin():
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    done.wait()
    del server  # joins llama.cpp's threads
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a GGUF file (make_model.py writes one)")
    parser.add_argument("-n", type=int, default=2, help="how many servers (default 2)")
    parser.add_argument("--slots", type=int, default=4, help="parallel slots per server (-np)")
    parser.add_argument("--ctx-per-slot", type=int, default=4096, help="context tokens per slot")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per server")
    parser.add_argument("--cache-ram-mib", type=int, default=None,
                        help="host-memory prompt cache (llama.cpp default 8192; 0 disables)")
    parser.add_argument("--kv-unified", action="store_true",
                        help="one KV buffer shared by the slots (-kvu); idle slots are then saved "
                             "to the host-memory prompt cache and cleared when a task starts")
    parser.add_argument("--slot-similarity", type=float, default=None,
                        help="-sps: reuse the idle slot sharing this fraction of the prompt "
                             "(llama.cpp default 0.1; 0 always takes the least recently used slot)")
    parser.add_argument("--alias", default="tiny", help="the model name the servers report")
    parser.add_argument("--log-dir", default=None, help="server logs (default $KVROUTE_E2E_LOGS or /tmp)")
    parser.add_argument("--ports", default=None,
                        help="comma-separated fixed ports, one per server (default: free ports)")
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)  # a child's own
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    ports = None if args.ports is None else [int(p) for p in args.ports.split(",")]
    servers = start_servers(args.model, args.n, args.slots, args.ctx_per_slot, args.threads,
                            args.cache_ram_mib, args.alias, args.log_dir, args.kv_unified,
                            args.slot_similarity, ports)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        for s in servers:
            print(f"llamacpp i={s.index} url={s.url} pid={s.proc.pid}", flush=True)

        def wait_stdin():
            sys.stdin.read()
            done.set()

        threading.Thread(target=wait_stdin, daemon=True).start()
        done.wait()
    finally:
        stop_servers(servers)


if __name__ == "__main__":
    main()
