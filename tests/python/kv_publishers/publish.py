"""Drive a real vLLM or SGLang KV event publisher from a small line protocol, for kvroute's tests.

    publish.py --engine vllm|vllm010|sglang [--block-size N] [--hash-format int|bytes]
               [--topic T] [--buffer-steps N]
    publish.py --check          # exit 0 when the pinned engines and modules are installed

On start it prints one JSON line `{"ready": true, "endpoint": ..., "replay_endpoint": ...}`
(tcp://127.0.0.1:PORT), then reads one JSON command per line on stdin and answers each with one
JSON line (`{"ok": true, ...}` or `{"ok": false, "error": ...}`):

- `{"op": "publish", "events": [EVENT...], "dp_rank": 0, "drop": false}` publishes one batch.
  With `"drop": true` the batch is numbered and kept in the engine's replay buffer but never
  reaches the PUB socket, so a subscriber sees a gap that only replay can fill. Answers `seq`
  (the batch's sequence number) and `hashes`: per event, the engine block hashes it carries, as
  unsigned 64-bit integers (what the router sees). Answers once the publisher thread sent it.
  `"repeat": n` publishes the same batch n times (numbered seq..seq+n).
- `{"op": "restart"}` shuts the publisher down and starts a new one on the same ports, numbering
  from 0 again, as an engine restart does.
- `{"op": "quit"}`.

EVENT is engine-neutral; the script turns it into the engine's own event objects:
- `{"type": "stored", "request": REQ, "from_block": 0, "to_block": null, "medium": null,
  "group": null, "kind": null, "locality": null}`: the request's full blocks
  `from_block..to_block` became cached, continuing block `from_block - 1` (as vLLM's
  `cache_full_blocks` and SGLang's radix insert emit them).
- `{"type": "removed", "request": REQ, "from_block": 0, "to_block": null, "medium": null,
  "group": null}`: those blocks were evicted.
- `{"type": "cleared"}`.

REQ is `{"tokens": [...], "salt": null, "lora": null, "mm": [{"id": ..., "offset": ...,
"length": ...}]}` (`lora` and `mm` vLLM 0.33 only).

Engines:
- `vllm`: vLLM 0.33.0's `ZmqEventPublisher` and event structs (msgpack maps), per-block
  `extra_keys` from vLLM's own `generate_block_hash_extra_keys` / `to_event_extra_keys`, one
  `BlockRemoved` per block as its block pool emits them.
- `sglang`: SGLang 0.5.23's `ZmqEventPublisher`, with events made by its own
  `KVCacheEventRecorder` (one page per `--block-size` tokens, SGLang's `--page-size`).
- `vllm010`: vLLM 0.10 is not installed: its event structs (arrays: `array_like=True`) and its
  three-frame replay answer `[b"", seq, payload]` are emulated on top of the 0.33 publisher.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import socket
import sys
import time
import types
from typing import Any, Optional

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import standins  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["vllm", "vllm010", "sglang"])
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--hash-format", choices=["int", "bytes"], default="int")
    parser.add_argument("--topic", default="")
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    try:
        standins.check_dependencies()
        vllm = standins.load_vllm()
        sglang = standins.load_sglang()
    except standins.SetupError as e:
        print(f"kv_publishers setup: {e}", file=sys.stderr)
        if not args.check:  # the Rust tests print their own hint after --check
            print(standins.SETUP_HINT, file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps({"ok": True}))
        return 0
    if args.engine is None:
        parser.error("--engine is required")
    if args.engine == "sglang":
        engine: Engine = SglangEngine(sglang, args)
    elif args.engine == "vllm":
        engine = VllmEngine(vllm, args)
    else:
        engine = Vllm010Engine(vllm, args)
    reply({"ready": True, **engine.endpoints()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            op = command["op"]
            if op == "quit":
                break
            if op == "publish":
                reply({"ok": True, **engine.publish(command)})
            elif op == "restart":
                engine.restart()
                reply({"ok": True, **engine.endpoints()})
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001  (reported to the test, which fails on it)
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    engine.shutdown()
    return 0


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


U64 = (1 << 64) - 1


class DroppingSocket:
    """Wraps the publisher's PUB socket: batches whose sequence number is listed are not sent."""

    def __init__(self, socket: Any):
        self._socket = socket
        self.drop: set[int] = set()

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            self.drop.discard(seq)
            return None
        return self._socket.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


class Engine:
    """One engine's publisher, restartable, with the bookkeeping to number and drop batches."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.block_size = args.block_size
        self.publisher: Any = None
        self.socket: Optional[DroppingSocket] = None
        self.next_seq = 0
        self.ports: Optional[tuple[int, int]] = None
        self._start()

    # Implemented per engine.
    def _new_publisher(self) -> Any: ...
    def _pub_endpoint(self) -> str: ...
    def _replay_endpoint(self) -> str: ...
    def _batch(self, events: list[Any], dp_rank: int) -> Any: ...
    def _events(self, spec: dict[str, Any]) -> tuple[list[Any], list[int]]: ...

    def _start(self) -> None:
        self.publisher = self._new_publisher()
        self.socket = DroppingSocket(self.publisher._pub)
        self.publisher._pub = self.socket
        self.next_seq = 0
        self.ports = (port_of(self._pub_endpoint()), port_of(self._replay_endpoint()))

    def endpoints(self) -> dict[str, str]:
        assert self.ports is not None
        return {
            "endpoint": f"tcp://127.0.0.1:{self.ports[0]}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.ports[1]}",
        }

    def publish(self, command: dict[str, Any]) -> dict[str, Any]:
        events: list[Any] = []
        hashes: list[list[int]] = []
        for spec in command.get("events", []):
            made, spec_hashes = self._events(spec)
            events.extend(made)
            hashes.append([h & U64 for h in spec_hashes])
        first = self.next_seq
        dp_rank = int(command.get("dp_rank", 0))
        assert self.socket is not None
        for _ in range(int(command.get("repeat", 1))):
            if command.get("drop"):
                self.socket.drop.add(self.next_seq)
            self.next_seq += 1
            self.publisher.publish(self._batch(events, dp_rank))
        self._wait_sent()
        return {"seq": first, "hashes": hashes}

    def _wait_sent(self) -> None:
        queue = self.publisher._event_queue
        deadline = time.monotonic() + 30
        while queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)
        if queue.unfinished_tasks:
            raise RuntimeError("the publisher thread did not send the batch within 30 s")

    def restart(self) -> None:
        self.shutdown()
        assert self.ports is not None
        for port in self.ports:
            wait_port_free(port)
        self._start()

    def shutdown(self) -> None:
        self.publisher.shutdown()


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def wait_port_free(port: int) -> None:
    """Waits until a closed zmq socket's listener is gone (zmq closes sockets asynchronously)."""
    deadline = time.monotonic() + 30
    while True:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
        finally:
            probe.close()


# --- vLLM 0.33 -------------------------------------------------------------------------------


class LoraRequest:
    """The attributes of vLLM's LoRARequest that event and extra-key code reads."""

    def __init__(self, name: str):
        self.lora_name = name
        self.name = name
        self.lora_path = f"/adapters/{name}"
        self.adapter_id = 1 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")


class Request:
    """The attributes of vLLM's Request that `generate_block_hash_extra_keys` reads."""

    def __init__(self, spec: dict[str, Any]):
        self.all_token_ids = list(spec["tokens"])
        self.cache_salt = spec.get("salt")
        lora = spec.get("lora")
        self.lora_request = LoraRequest(lora) if lora else None
        self.mm_features = [
            types.SimpleNamespace(
                identifier=mm["id"],
                mm_position=types.SimpleNamespace(offset=mm["offset"], length=mm["length"]),
            )
            for mm in spec.get("mm", [])
        ]
        self.prompt_embeds = None
        self.session_id = None


class VllmEngine(Engine):
    NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()

    def __init__(self, vllm: types.SimpleNamespace, args: argparse.Namespace):
        self.vllm = vllm
        self.kv = vllm.kv_events
        super().__init__(args)

    def _new_publisher(self) -> Any:
        endpoint, replay = "tcp://*:0", "tcp://*:0"
        if self.ports is not None:
            endpoint, replay = (f"tcp://*:{port}" for port in self.ports)
        return self.publisher_class()(
            data_parallel_rank=0,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=self.args.buffer_steps,
            topic=self.args.topic,
        )

    def publisher_class(self) -> Any:
        return self.kv.ZmqEventPublisher

    def _pub_endpoint(self) -> str:
        return self.publisher._endpoint

    def _replay_endpoint(self) -> str:
        return self.publisher._replay_endpoint

    def _batch(self, events: list[Any], dp_rank: int) -> Any:
        return self.kv.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=dp_rank)

    def chain(self, request: Request) -> list[tuple[bytes, Any]]:
        """Every full block's hash and (tagged) extra keys, as vLLM's block hasher makes them."""
        out = []
        parent = self.NONE_HASH
        bs = self.block_size
        for start in range(0, len(request.all_token_ids) // bs * bs, bs):
            extra, _ = self.vllm.generate_block_hash_extra_keys(request, start, start + bs, 0)
            tokens = tuple(request.all_token_ids[start : start + bs])
            parent = hashlib.sha256(pickle.dumps((parent, tokens, extra))).digest()
            out.append((parent, extra))
        return out

    def external(self, block_hash: bytes) -> Any:
        """vLLM's `maybe_convert_block_hash`."""
        if self.args.hash_format == "bytes":
            return block_hash
        return int.from_bytes(block_hash, "big") & U64

    def _events(self, spec: dict[str, Any]) -> tuple[list[Any], list[int]]:
        kind = spec["type"]
        if kind == "cleared":
            return [self.kv.AllBlocksCleared()], []
        request = Request(spec["request"])
        chain = self.chain(request)
        first = spec.get("from_block", 0)
        last = spec.get("to_block")
        last = len(chain) if last is None else last
        blocks = chain[first:last]
        ints = [int.from_bytes(h, "big") & U64 for h, _ in blocks]
        medium = spec.get("medium") or self.kv.MEDIUM_GPU
        group = spec.get("group")
        group = 0 if group is None else group
        if kind == "removed":
            # The block pool emits one BlockRemoved per evicted block.
            return [
                self.kv.BlockRemoved(
                    block_hashes=[self.external(h)],
                    medium=medium,
                    group_idx=group,
                    locality=spec.get("locality"),
                )
                for h, _ in blocks
            ], ints
        bs = self.block_size
        lora = request.lora_request
        event = self.kv.BlockStored(
            block_hashes=[self.external(h) for h, _ in blocks],
            parent_block_hash=self.external(chain[first - 1][0]) if first > 0 else None,
            token_ids=request.all_token_ids[first * bs : last * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=medium,
            lora_name=lora.name if lora else None,
            extra_keys=self.vllm.to_event_extra_keys([extra for _, extra in blocks]),
            group_idx=group,
            kv_cache_spec_kind=spec.get("kind") or "full_attention",
            locality=spec.get("locality"),
        )
        return [event], ints


# --- vLLM 0.10 (emulated) --------------------------------------------------------------------


class Vllm010Engine(VllmEngine):
    """vLLM 0.10's wire format: array-encoded events and a three-frame replay answer."""

    def __init__(self, vllm: types.SimpleNamespace, args: argparse.Namespace):
        import msgspec

        class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: list[Any]
            data_parallel_rank: Optional[int] = None

        class KVCacheEvent(
            msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
        ):
            pass

        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: Optional[int]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[int]
            medium: Optional[str]

        class AllBlocksCleared(KVCacheEvent):
            pass

        self.v010 = types.SimpleNamespace(
            EventBatch=EventBatch,
            BlockStored=BlockStored,
            BlockRemoved=BlockRemoved,
            AllBlocksCleared=AllBlocksCleared,
        )
        super().__init__(vllm, args)

    def publisher_class(self) -> Any:
        base = self.kv.ZmqEventPublisher

        class Publisher(base):  # type: ignore[misc, valid-type]
            def _service_replay(self) -> None:
                # vLLM 0.10's answer: [identity, b"", seq, payload] (no topic frame).
                frame = self._replay.recv_multipart()
                if len(frame) != 3:
                    return
                client_id, _, start_seq_bytes = frame
                start_seq = int.from_bytes(start_seq_bytes, "big")
                for seq, buf in self._buffer:
                    if seq >= start_seq:
                        self._replay.send_multipart(
                            (client_id, b"", seq.to_bytes(8, "big"), buf)
                        )
                self._replay.send_multipart((client_id, b"", self.END_SEQ, b""))

        return Publisher

    def _batch(self, events: list[Any], dp_rank: int) -> Any:
        return self.v010.EventBatch(ts=time.time(), events=events, data_parallel_rank=dp_rank)

    @staticmethod
    def signed(block_hash: bytes) -> int:
        # vLLM 0.10 published Python-int block hashes, negative ones included.
        return int.from_bytes(block_hash[:8], "big", signed=True)

    def _events(self, spec: dict[str, Any]) -> tuple[list[Any], list[int]]:
        kind = spec["type"]
        if kind == "cleared":
            return [self.v010.AllBlocksCleared()], []
        request = Request(spec["request"])
        chain = self.chain(request)
        first = spec.get("from_block", 0)
        last = spec.get("to_block")
        last = len(chain) if last is None else last
        hashes = [self.signed(h) for h, _ in chain[first:last]]
        medium = spec.get("medium") or "GPU"
        if kind == "removed":
            return [self.v010.BlockRemoved(block_hashes=hashes, medium=medium)], hashes
        bs = self.block_size
        event = self.v010.BlockStored(
            block_hashes=hashes,
            parent_block_hash=self.signed(chain[first - 1][0]) if first > 0 else None,
            token_ids=request.all_token_ids[first * bs : last * bs],
            block_size=bs,
            lora_id=None,
            medium=medium,
        )
        return [event], hashes


# --- SGLang 0.5.23 ---------------------------------------------------------------------------


class RadixKey:
    """The attributes of SGLang's RadixKey that the event recorder and hash helpers read."""

    def __init__(self, token_ids: list[int], cache_salt: Optional[str]):
        self.token_ids = token_ids
        self.extra_key = None
        self.cache_salt = cache_salt
        self.is_bigram = False

    def __len__(self) -> int:
        return len(self.token_ids)


class TreeNode:
    """The attributes of SGLang's radix tree node that the event recorder reads."""

    def __init__(self, key: RadixKey, parent: Optional["TreeNode"]):
        self.key = key
        self.parent = parent
        self.hash_value: Optional[list[str]] = None
        self.event_hash_value: Optional[list[str]] = None


class SglangEngine(Engine):
    def __init__(self, sglang: types.SimpleNamespace, args: argparse.Namespace):
        self.kv = sglang.kv_events
        self.recorder = sglang.recorder.KVCacheEventRecorder(
            enabled=True, page_size=args.block_size
        )
        self.root = TreeNode(RadixKey([], None), None)
        self.root.hash_value = []
        # Nodes by (salt, tokens up to the node's end): a stored range is one radix node.
        self.nodes: dict[tuple[Optional[str], tuple[int, ...]], TreeNode] = {}
        super().__init__(args)

    def _new_publisher(self) -> Any:
        endpoint, replay = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
        if self.ports is not None:
            endpoint, replay = (f"tcp://127.0.0.1:{port}" for port in self.ports)
        return self.kv.ZmqEventPublisher(
            attn_dp_rank=0,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=self.args.buffer_steps,
            topic=self.args.topic,
            bind=True,
        )

    def _pub_endpoint(self) -> str:
        return self.publisher._local_pub_endpoint

    def _replay_endpoint(self) -> str:
        return self.publisher._local_replay_endpoint

    def _batch(self, events: list[Any], dp_rank: int) -> Any:
        return self.kv.KVEventBatch(ts=time.time(), events=events, attn_dp_rank=dp_rank)

    def restart(self) -> None:
        super().restart()
        self.nodes.clear()

    def _events(self, spec: dict[str, Any]) -> tuple[list[Any], list[int]]:
        kind = spec["type"]
        if kind == "cleared":
            self.recorder.record_all_cleared()
            return self.recorder.take(), []
        request = spec["request"]
        salt = request.get("salt")
        bs = self.block_size
        tokens = list(request["tokens"])
        first = spec.get("from_block", 0)
        last = spec.get("to_block")
        last = len(tokens) // bs if last is None else last
        parent_key = (salt, tuple(tokens[: first * bs]))
        parent = self.root if first == 0 else self.nodes[parent_key]
        node_key = (salt, tuple(tokens[: last * bs]))
        medium = self.kv.StorageMedium(spec.get("medium") or "GPU")
        if kind == "stored":
            node = self.nodes.get(node_key)
            if node is None:
                node = TreeNode(RadixKey(tokens[first * bs : last * bs], salt), parent)
                self.nodes[node_key] = node
            self.recorder.record_store(node, medium=medium)
        else:
            self.recorder.record_remove(self.nodes[node_key], medium=medium)
        events = self.recorder.take()
        hashes = [h for event in events for h in event.block_hashes]
        return events, hashes


if __name__ == "__main__":
    sys.exit(main())
