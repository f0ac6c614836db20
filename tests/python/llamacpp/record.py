#!/usr/bin/env python3
"""Records real HTTP exchanges with llama.cpp's server, for kvroute's engine tests to replay.

Usage: python3 record.py [OUT_DIR]
(default: crates/kvroute-engines/tests/fixtures/llamacpp of this checkout)

Makes the tiny model (make_model.py, seed 0) in a fixed scratch directory, starts one server
(servers.py: 4 slots of 4,096 tokens, one CPU thread), and for each exchange NAME writes
  NAME.request.json   the request body exactly as sent (absent for a GET)
  NAME.response.sse   the response body exactly as received (after HTTP chunked decoding), for
                      `text/event-stream`; NAME.response.json or NAME.response.txt otherwise
  NAME.meta.json      method, path, HTTP status, content type, the file names, and a note
The exchanges run in a fixed order on one server, so the cache counts they show follow from the
ones before (each note says what to expect). Generation is greedy (`temperature: 0`), so the
token ids are the same each time; timings differ.

Needs the `xllamacpp`, `gguf` and `numpy` packages (tests/python/requirements.txt).
"""

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree when importing servers.py

from servers import start_servers, stop_servers  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "..", "..", "..", "crates", "kvroute-engines", "tests", "fixtures",
                           "llamacpp")
# A fixed place, so that the model path the server reports (in /props) is the same every time.
MODEL_DIR = "/tmp/kvroute-llamacpp-record"
TIMEOUT = 30.0

SYSTEM = "You are a careful assistant. Answer the question of the user in a short and friendly way."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Tell me about caches and routing."},
]


class Recorder:
    def __init__(self, url, out):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.out = host, int(port), out
        self.index = []

    def connect(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)

    def exchange(self, name, method, path, body=None, note=""):
        """Sends one request, saves it and the response; returns (status, parsed or raw body)."""
        conn = self.connect()
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        self.save(name, method, path, data, response, raw, note)
        return response.status, parse(response, raw)

    def save(self, name, method, path, data, response, raw, note, extra=None):
        content_type = response.getheader("content-type", "")
        ext = "sse" if "event-stream" in content_type else "json" if "json" in content_type else "txt"
        meta = {
            "method": method,
            "path": path,
            "request": None,
            "status": response.status,
            "content_type": content_type,
            "response": f"{name}.response.{ext}",
            "note": note,
        }
        if data is not None:
            meta["request"] = f"{name}.request.json"
            with open(os.path.join(self.out, meta["request"]), "wb") as f:
                f.write(data)
        if extra:
            meta.update(extra)
        with open(os.path.join(self.out, meta["response"]), "wb") as f:
            f.write(raw)
        with open(os.path.join(self.out, f"{name}.meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        self.index.append((name, method, path, response.status, note))

    def get_json_post(self, path, body):
        conn = self.connect()
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read())
        conn.close()
        return data

    def get_json(self, path):
        conn = self.connect()
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return json.loads(body) if "json" in response.getheader("content-type", "") else body.decode()


def parse(response, raw):
    content_type = response.getheader("content-type", "")
    if "event-stream" in content_type:
        return sse_events(raw)
    if "json" in content_type:
        return json.loads(raw)
    return raw.decode()


def sse_events(raw):
    """The `data:` payloads of an SSE body, JSON-decoded where they are JSON."""
    events = []
    for block in raw.decode().split("\n\n"):
        data = "\n".join(l[5:].lstrip(" ") for l in block.split("\n") if l.startswith("data:"))
        if data:
            try:
                events.append(json.loads(data))
            except json.JSONDecodeError:
                events.append(data)
    return events


def streamed_ids(events):
    return [t for e in events if isinstance(e, dict) for t in e.get("tokens", [])]


def completion(prompt, n_predict, stream=True, **extra):
    """A /completion body as kvroute's llama.cpp dialect sends it."""
    body = {"model": "tiny", "prompt": prompt, "n_predict": n_predict, "stream": stream,
            "return_tokens": True, "cache_prompt": True, "temperature": 0.0, "seed": 42}
    body.update(extra)
    return body


def record_all(rec):
    rec.exchange("health", "GET", "/health", note="liveness: 200 {\"status\":\"ok\"} once the model is loaded")
    rec.exchange("props", "GET", "/props",
                 note="server properties: default generation settings, total_slots, the chat template")
    _, applied = rec.exchange("apply_template", "POST", "/apply-template", {"messages": MESSAGES},
                              note="the model's ChatML template rendered by the server's Jinja engine")
    text = applied["prompt"]
    _, tokenized = rec.exchange("tokenize", "POST", "/tokenize", {"content": text},
                                note="text to ids; special tokens in the text are parsed, no BOS "
                                     "is added (the model says add_bos_token = false)")
    prompt = tokenized["tokens"]
    rec.exchange("tokenize_pieces", "POST", "/tokenize", {"content": text, "with_pieces": True},
                 note="with_pieces: [{id, piece}], a piece that is not valid UTF-8 comes as a byte list")
    rec.exchange("detokenize", "POST", "/detokenize", {"tokens": prompt},
                 note="ids to text, special tokens rendered")

    n = len(prompt)
    _, first = rec.exchange(
        "completion_stream", "POST", "/completion", completion(prompt, 16),
        note=f"a fresh {n}-token prompt: one chunk per token {{index, content, tokens: [id], stop: "
             f"false, id_slot: -1, tokens_predicted, tokens_evaluated}}, then a last chunk with "
             f"stop: true, content \"\", tokens [], id_slot, model, generation_settings, prompt "
             f"(as text), truncated, stop_type \"limit\", stopping_word, tokens_cached "
             f"(= prompt + generated - 1 = {n + 15}) and timings {{cache_n: 0, prompt_n: {n}, "
             f"predicted_n, ...}}; no usage object")
    output = streamed_ids(first)
    last = first[-1]
    assert len(output) == 16 and all(len(e["tokens"]) == 1 for e in first[:-1]), first
    assert last["stop"] and last["stop_type"] == "limit" and last["tokens"] == [] and last["content"] == ""
    assert last["timings"]["cache_n"] == 0 and last["tokens_cached"] == n + 15, last
    _, again = rec.exchange(
        "completion_stream_repeat", "POST", "/completion", completion(prompt, 16),
        note=f"the same prompt again: timings.cache_n = {n - 1}, prompt_n = 1 (the last prompt "
             f"token is always evaluated again, to get its logits); same ids (greedy)")
    assert again[-1]["timings"]["cache_n"] == n - 1 and streamed_ids(again) == output, again[-1]
    turn2 = rec.exchange("tokenize_turn2", "POST", "/tokenize",
                         {"content": "<|im_end|>\n<|im_start|>user\nAnd how does the engine pick a "
                                     "slot?<|im_end|>\n<|im_start|>assistant\n"},
                         note="the next user turn, to extend the conversation")[1]["tokens"]
    extended = prompt + output + turn2
    _, ext = rec.exchange(
        "completion_stream_extend", "POST", "/completion", completion(extended, 8),
        note=f"prompt + the 16 generated ids + a new turn ({len(extended)} tokens): timings.cache_n "
             f"= {n + 15}: the prompt and every generated id but the last (a sampled token enters "
             f"the KV cache only when the next one is computed)")
    assert ext[-1]["timings"]["cache_n"] == n + 15, ext[-1]
    stop_text = first[7]["content"] + first[8]["content"]
    _, stopped = rec.exchange(
        "completion_stream_stop", "POST", "/completion", completion(prompt, 16, stop=[stop_text]),
        note=f"stop string {stop_text!r} (the text of generated tokens 8 and 9): the ids that make "
             f"up the stop string ARE streamed, in chunks with empty content (text that may start "
             f"the stop string is held back, then dropped); the chunk that completes it also "
             f"carries timings; the last chunk says stop_type \"word\", stopping_word, and "
             f"tokens_predicted counts those ids")
    assert stopped[-1]["stop_type"] == "word" and stopped[-1]["stopping_word"] == stop_text
    assert streamed_ids(stopped) == output[:9] and stopped[-2]["content"] == "", stopped
    _, stopped_whole = rec.exchange(
        "completion_stop", "POST", "/completion", completion(prompt, 16, stream=False, stop=[stop_text]),
        note="the same, not streamed: content ends before the stop string, tokens still holds "
             "the ids that made it up")
    _, eos = rec.exchange(
        "completion_stream_eos", "POST", "/completion", completion(prompt, 16, logit_bias=[[4, 100.0]]),
        note="<|im_end|> (id 4, the model's EOS and EOT) forced by logit_bias: it IS streamed, as a "
             "chunk with tokens [4] and empty content, then the last chunk says stop_type \"eos\" "
             "and tokens_predicted 1")
    assert eos[0]["tokens"] == [4] and eos[-1]["stop_type"] == "eos", eos
    rec.exchange("completion", "POST", "/completion", completion(prompt, 8, stream=False),
                 note="not streamed: one JSON object like the last chunk, with the whole content "
                      "and every id in tokens")
    rec.exchange("completion_stream_n_probs", "POST", "/completion", completion(prompt, 3, n_probs=1),
                 note="n_probs: each chunk carries completion_probabilities [{id, token, bytes, "
                      "logprob, top_logprobs}] (log probabilities unless post_sampling_probs)")
    _, ignored = rec.exchange(
        "completion_stream_ignore_eos", "POST", "/completion",
        completion(prompt, 4, logit_bias=[[4, 100.0]], ignore_eos=True),
        note="ignore_eos: true with <|im_end|> favoured: the end tokens are masked, generation "
             "runs to the limit")
    assert 4 not in streamed_ids(ignored) and ignored[-1]["stop_type"] == "limit", ignored
    rec.exchange("completion_error_empty_prompt", "POST", "/completion", completion([], 4),
                 note="an empty prompt: 400 before any streaming, {error: {code, message, type}}")
    rec.exchange("completion_error_bad_field", "POST", "/completion", completion(prompt, "many"),
                 note="a field of the wrong type: 400 invalid_request_error")
    rec.exchange("completion_error_invalid_token", "POST", "/completion", completion([3, 99999], 4),
                 note="a token id outside the vocabulary: 400")
    rec.exchange("completion_error_too_long", "POST", "/completion", completion([300] * 5000, 4),
                 note="a prompt longer than a slot's context (4,096): 400 exceed_context_size_error "
                      "with n_prompt_tokens and n_ctx, even with stream: true")
    body = completion(prompt, 4)
    del body["prompt"]
    rec.exchange("completion_error_missing_prompt", "POST", "/completion", body,
                 note="no prompt field: 400")
    _, v1 = rec.exchange("v1_completions_stream", "POST", "/v1/completions",
                 {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True}, "return_tokens": True,
                  "temperature": 0.0},
                 note=f"OpenAI-style, prompt as ids: return_tokens is ignored (text only); the chunk "
                      f"with finish_reason also has usage.prompt_tokens_details.cached_tokens "
                      f"(= {n - 1} here) and timings; ends with data: [DONE]")
    assert all("tokens" not in e for e in v1 if isinstance(e, dict)) and v1[-1] == "[DONE]", v1
    assert v1[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1, v1[-2]
    rec.exchange("v1_completions", "POST", "/v1/completions",
                 {"model": "tiny", "prompt": prompt, "max_tokens": 4, "return_tokens": True,
                  "temperature": 0.0},
                 note="not streamed: usage.prompt_tokens_details.cached_tokens, timings, no ids")
    rec.exchange("v1_chat_completions_stream", "POST", "/v1/chat/completions",
                 {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": 0.0},
                 note="chat through the server's own template; the role chunk comes first, usage "
                      "in a separate last chunk with empty choices")
    rec.exchange("slots", "GET", "/slots", note="idle: every slot with is_processing false")
    record_cancel(rec, prompt)
    record_slot_reuse(rec)
    rec.exchange("metrics", "GET", "/metrics",
                 note="Prometheus text (--metrics): llamacpp:prompt_tokens_total, "
                      "llamacpp:tokens_predicted_total, llamacpp:requests_processing, ... "
                      "after all of the above")


def record_cancel(rec, prompt):
    """A long stream whose client goes away: does llama.cpp free the slot?"""
    before = rec.get_json("/metrics")
    body = json.dumps(completion(prompt, 3000)).encode()
    conn = rec.connect()
    conn.request("POST", "/completion", body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    raw = b""
    while raw.count(b"\n\n") < 8:
        raw += response.read1(65536)
    raw = raw[: nth(raw, b"\n\n", 8) + 2]
    rec.exchange("slots_busy", "GET", "/slots",
                 note="while the 3000-token stream of `cancel` runs: its slot has is_processing true, "
                      "id_task, n_prompt_tokens, params and next_token[0].n_decoded")
    t0 = time.monotonic()
    # The client goes away without reading the rest.
    conn.sock.shutdown(socket.SHUT_RDWR)
    response.close()
    conn.close()
    while any(s["is_processing"] for s in rec.get_json("/slots")):
        if time.monotonic() - t0 > TIMEOUT:
            raise SystemExit("the slot was not released after the client closed its connection")
        time.sleep(0.005)
    released_ms = (time.monotonic() - t0) * 1000
    after = rec.get_json("/metrics")
    predicted = metric(after, "llamacpp:tokens_predicted_total") - metric(before, "llamacpp:tokens_predicted_total")
    rec.save("cancel", "POST", "/completion", body, response, raw,
             note=f"n_predict 3000, the client read 8 chunks then closed the connection: the server "
                  f"logs `cancel task` and releases the slot ({released_ms:.0f} ms after the close "
                  f"here; see slots_after_cancel) after {predicted:.0f} tokens, not 3000 "
                  f"(llamacpp:tokens_predicted_total). The response file holds the chunks read.",
             extra={"partial": True, "slot_released_after_close_ms": round(released_ms),
                    "tokens_predicted_before_release": int(predicted)})
    rec.exchange("slots_after_cancel", "GET", "/slots",
                 note="after the cancelled stream: no slot processing")


def record_slot_reuse(rec):
    """Two conversations sharing a long system prompt on a server with idle slots to spare."""
    system = "You are the shared assistant of one family of conversations. " * 12
    def ids(user):
        text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        return rec.get_json_post("/tokenize", {"content": text})["tokens"]
    a, b = ids("What is a prefix cache?"), ids("How does a router pick a worker?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    _, first = rec.exchange("slot_reuse_1", "POST", "/completion", completion(a, 4),
                            note=f"conversation A ({len(a)} tokens, a {shared}-token prefix shared "
                                 f"with B) on a server whose other slots hold unrelated prompts")
    assert first[-1]["timings"]["cache_n"] < 16, first[-1]
    _, second = rec.exchange(
        "slot_reuse_2", "POST", "/completion", completion(b, 4),
        note=f"conversation B: llama.cpp gives it A's idle slot (the one sharing the largest "
             f"fraction of B, above --slot-prompt-similarity 0.1) although other slots are idle; "
             f"cache_n = {shared} (the shared prefix)")
    assert second[-1]["timings"]["cache_n"] == shared and second[-1]["id_slot"] == first[-1]["id_slot"]
    _, third = rec.exchange(
        "slot_reuse_3", "POST", "/completion", completion(a, 4),
        note=f"A again: only the shared prefix is cached (cache_n = {shared}, not {len(a) - 1}): "
             f"B's request kept half or more of the slot (f_keep >= 0.5), so A's own tokens were "
             f"overwritten without a copy in the host-memory prompt cache (which takes one only "
             f"when a slot is taken by LRU or keeps less than half). Conversations sharing a long "
             f"prefix thus evict each other on one llama.cpp server")
    assert third[-1]["timings"]["cache_n"] == shared, third[-1]


def nth(raw, sep, n):
    at = -1
    for _ in range(n):
        at = raw.index(sep, at + 1)
    return at


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise SystemExit(f"no {name} in /metrics")


def write_index(rec, out):
    import xllamacpp

    lines = [
        "| exchange | request | status | what it shows |",
        "| --- | --- | --- | --- |",
    ]
    for name, method, path, status, note in rec.index:
        cell = note.replace("|", "\\|")
        lines.append(f"| `{name}` | `{method} {path}` | {status} | {cell} |")
    with open(os.path.join(out, "INDEX.md"), "w") as f:
        f.write(f"# Recorded exchanges (xllamacpp {xllamacpp.__version__}, model seed 0)\n\n")
        f.write("Written by tests/python/llamacpp/record.py; see README.md.\n\n")
        f.write("\n".join(lines) + "\n")


def main():
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.endswith((".request.json", ".meta.json", ".response.sse", ".response.json",
                          ".response.txt")):
            os.remove(os.path.join(out, name))
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), MODEL_DIR, "--seed", "0"],
                   check=True)
    servers = start_servers(os.path.join(MODEL_DIR, "model.gguf"), 1, slots=4, ctx_per_slot=4096,
                            log_dir=MODEL_DIR)
    try:
        rec = Recorder(servers[0].url, out)
        record_all(rec)
        write_index(rec, out)
    finally:
        stop_servers(servers)
    print(f"recorded {len(rec.index)} exchanges into {out}")


if __name__ == "__main__":
    main()
