#!/usr/bin/env python3
"""Black-box check that a stock OpenAI client works against `kvroute serve` unchanged.

Starts `kvroute serve` and three `kvroute worker --mock` processes on loopback (ports picked by
the OS), then uses the `openai` package from PyPI: a streaming chat completion with
`extra_body={"nvext": ...}` asking for the serving worker, a second turn of the same
conversation that must land on the same worker, a non-streaming completion, and the model list.
Every child process is stopped on exit; every wait is bounded.

Usage: python3 tests/openai_client.py [PATH_TO_KVROUTE_BINARY]
(default: $CARGO_TARGET_DIR/debug/kvroute, else target/debug/kvroute)
"""

import os
import subprocess
import sys
import threading
import time

try:
    import openai
except ImportError:
    sys.exit("the `openai` package is missing: pip install openai (cargo xtask ci does this in a venv)")

STEP_TIMEOUT = 30.0


def binary_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "target"
    )
    return os.path.join(target, "debug", "kvroute")


def start(args, log_path):
    """Starts a kvroute process and returns it with the fields of its readiness line."""
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
    line = {}

    def read_first_line():
        line["text"] = proc.stdout.readline()
        # Keep draining so the child never blocks on a full pipe.
        for _ in proc.stdout:
            pass

    threading.Thread(target=read_first_line, daemon=True).start()
    deadline = time.monotonic() + STEP_TIMEOUT
    while "text" not in line:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"{args} did not become ready; see {log_path}")
        time.sleep(0.02)
    fields = dict(w.split("=", 1) for w in line["text"].split() if "=" in w)
    return proc, fields


def worker_of(nvext):
    assert nvext and "worker_id" in nvext, f"no nvext.worker_id in {nvext}"
    return nvext["worker_id"]["decode_worker_id"]


def main():
    kvroute = binary_path()
    if not os.path.exists(kvroute):
        raise SystemExit(f"kvroute binary not found at {kvroute}; build it with `cargo build -p kvroute`")
    log_dir = os.environ.get("KVROUTE_E2E_LOGS", "/tmp")
    procs = []
    try:
        serve, ready = start(
            [kvroute, "serve", "--listen", "127.0.0.1:0", "--registry-listen", "127.0.0.1:0"],
            os.path.join(log_dir, "kvroute-openai-serve.log"),
        )
        procs.append(serve)
        for worker_id in (1, 2, 3):
            worker, _ = start(
                [kvroute, "worker", "--mock", "--id", str(worker_id), "--router", ready["registry"],
                 "--speedup", "20"],
                os.path.join(log_dir, f"kvroute-openai-worker-{worker_id}.log"),
            )
            procs.append(worker)

        client = openai.OpenAI(
            base_url=f"http://{ready['http']}/v1", api_key="unused", timeout=STEP_TIMEOUT, max_retries=0
        )
        # The workers register asynchronously; wait until a request is served.
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            try:
                client.chat.completions.create(
                    model="mock", messages=[{"role": "user", "content": "ping"}], max_tokens=1
                )
                break
            except openai.APIStatusError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

        models = [m.id for m in client.models.list()]
        assert models == ["mock"], models

        system = {"role": "system", "content": "You are a helpful assistant. " * 20}
        first_turn = [system, {"role": "user", "content": "Tell me about KV caches. " * 8}]
        stream = client.chat.completions.create(
            model="mock",
            messages=first_turn,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"nvext": {"extra_fields": ["worker_id", "timing"]}},
        )
        text, finish, usage, nvext = "", None, None, None
        for chunk in stream:
            extra = getattr(chunk, "model_extra", None) or {}
            if extra.get("nvext"):
                nvext = extra["nvext"]
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert text, "no streamed text"
        assert finish == "length", finish
        assert usage is not None and usage.completion_tokens == 24, usage
        home = worker_of(nvext)

        time.sleep(0.2)  # let the worker's KV events reach the router
        second_turn = first_turn + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "And how does routing use them?"},
        ]
        reply = client.chat.completions.create(
            model="mock",
            messages=second_turn,
            max_tokens=8,
            extra_body={"nvext": {"extra_fields": ["worker_id"]}},
        )
        assert reply.choices[0].message.content, reply
        again = worker_of(reply.model_extra.get("nvext"))
        assert again == home, f"second turn went to worker {again}, the prefix is on {home}"

        completion = client.completions.create(model="mock", prompt="Once upon a time", max_tokens=5)
        assert completion.choices[0].text, completion
        print(f"openai client OK: streamed {usage.completion_tokens} tokens from worker {home}; "
              f"the second turn stayed there")
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
