"""Load the real KV event publishers of vLLM and SGLang without torch.

The engines' `kv_events.py` modules import only a handful of package modules (a logger, a
config dataclass, network helpers, a type alias); this module registers small stand-ins for
those under their real names in `sys.modules` and then executes the real files from the
installed wheels. Functions that live in heavy modules (vLLM's extra-key helpers in
`kv_cache_utils.py`, SGLang's hashing helpers in `mem_cache/utils.py`) are taken from the real
source file too: only their function definitions are compiled (annotations dropped), against a
namespace with the few names they use.

Nothing here changes what goes on the wire: the publisher classes, the event structs, the
msgspec encoding, the sequence numbering and the replay service are the engines' own code.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import logging
import sys
import types
from typing import Any, Optional

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"

SETUP_HINT = (
    "create the venv with `cargo xtask ci` (it installs tests/python/requirements.txt and "
    "requirements-nodeps.txt and sets KVROUTE_PYTHON), or by hand: "
    "python3 -m venv ~/.cache/kvroute/venv && "
    "~/.cache/kvroute/venv/bin/pip install -r tests/python/requirements.txt && "
    "~/.cache/kvroute/venv/bin/pip install --no-deps -r tests/python/requirements-nodeps.txt, "
    "then export KVROUTE_PYTHON=~/.cache/kvroute/venv/bin/python"
)


class SetupError(Exception):
    """The environment lacks what the real publishers need (`SETUP_HINT` says how to fix it)."""


def installed_file(dist: str, version: str, path: str) -> str:
    """The path of `path` inside the installed distribution `dist`, which must be `version`."""
    try:
        found = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError as e:
        raise SetupError(f"{dist}=={version} is not installed") from e
    if found != version:
        raise SetupError(f"{dist} {found} is installed, the tests need {version}")
    located = importlib.metadata.distribution(dist).locate_file(path)
    if not located.exists():
        raise SetupError(f"{dist} {version} has no {path}")
    return str(located)


def check_dependencies() -> None:
    for module in ("msgspec", "zmq"):
        try:
            __import__(module)
        except ImportError as e:
            raise SetupError(f"python module {module} is missing") from e


def _package(name: str) -> types.ModuleType:
    """An empty package registered as `name` (and its parents)."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix not in sys.modules:
            module = types.ModuleType(prefix)
            module.__path__ = []  # a package, so that submodules can be registered
            sys.modules[prefix] = module
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    return sys.modules[name]


def _module(name: str, **attrs: Any) -> types.ModuleType:
    parent, _, leaf = name.rpartition(".")
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    if parent:
        setattr(_package(parent), leaf, module)
    return module


def _exec_file(name: str, path: str) -> types.ModuleType:
    """Executes the real source file at `path` as module `name`."""
    parent, _, leaf = name.rpartition(".")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if parent:
        setattr(_package(parent), leaf, module)
    spec.loader.exec_module(module)
    return module


class _DropAnnotations(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        self.generic_visit(node)
        node.returns = None
        node.decorator_list = []
        args = node.args
        for arg in args.posonlyargs + args.args + args.kwonlyargs:
            arg.annotation = None
        for arg in (args.vararg, args.kwarg):
            if arg is not None:
                arg.annotation = None
        return node


def real_functions(path: str, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Compiles the named top-level functions of the source file at `path` into `namespace`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in wanted}
    if missing:
        raise SetupError(f"{path} no longer defines {sorted(missing)}")
    module = ast.Module(body=[_DropAnnotations().visit(n) for n in wanted], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), path, "exec"), namespace)
    return {name: namespace[name] for name in names}


# --- vLLM ------------------------------------------------------------------------------------


def load_vllm() -> types.SimpleNamespace:
    """vLLM 0.33's `vllm.distributed.kv_events` and its per-block extra-key helpers."""
    kv_events_path = installed_file("vllm", VLLM_VERSION, "vllm/distributed/kv_events.py")
    utils_path = installed_file("vllm", VLLM_VERSION, "vllm/v1/core/kv_cache_utils.py")

    @dataclasses.dataclass
    class KVEventsConfig:
        """Stand-in for vllm.config.kv_events.KVEventsConfig (a pydantic dataclass there)."""

        enable_kv_cache_events: bool = False
        publisher: Optional[str] = None
        endpoint: str = "tcp://*:5557"
        replay_endpoint: Optional[str] = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    def get_tcp_uri(ip: str, port: int) -> str:
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"

    def split_zmq_path(path: str) -> tuple[str, str, str]:
        scheme, _, rest = path.partition("://")
        host, _, port = rest.rpartition(":")
        return scheme, host.strip("[]"), port

    _package("vllm")
    _module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=get_tcp_uri,
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=split_zmq_path,
    )
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    kv_events = _exec_file("vllm.distributed.kv_events", kv_events_path)

    helpers = real_functions(
        utils_path,
        [
            "_gen_mm_extra_hash_keys",
            "_gen_lora_extra_hash_keys",
            "_gen_prompt_embeds_extra_hash_keys",
            "generate_block_hash_extra_keys",
            "to_event_extra_keys",
        ],
        {"Any": Any, "hashlib": hashlib},
    )
    return types.SimpleNamespace(kv_events=kv_events, **helpers)


# --- SGLang ----------------------------------------------------------------------------------


def load_sglang() -> types.SimpleNamespace:
    """SGLang 0.5.23's `sglang.srt.disaggregation.kv_events` and its event recorder."""
    kv_events_path = installed_file(
        "sglang", SGLANG_VERSION, "sglang/srt/disaggregation/kv_events.py"
    )
    recorder_path = installed_file("sglang", SGLANG_VERSION, "sglang/srt/mem_cache/events.py")
    utils_path = installed_file("sglang", SGLANG_VERSION, "sglang/srt/mem_cache/utils.py")

    try:
        import pydantic  # noqa: F401  (the real one, when the venv has it)
    except ImportError:

        class BaseModel:
            """Stand-in for pydantic.BaseModel: KVEventsConfig is declared, never used here."""

        _module("pydantic", BaseModel=BaseModel)

    class NetworkAddress:
        """Stand-in for sglang.srt.utils.network.NetworkAddress (host:port parsing)."""

        def __init__(self, host: str, port: int):
            self.host, self.port = host, port
            self.is_ipv6 = ":" in host

        @classmethod
        def parse(cls, text: str) -> "NetworkAddress":
            host, _, port = text.rpartition(":")
            return cls(host.strip("[]"), int(port))

        def to_tcp(self) -> str:
            host = f"[{self.host}]" if self.is_ipv6 else self.host
            return f"tcp://{host}:{self.port}"

    def get_parallel() -> types.SimpleNamespace:
        return types.SimpleNamespace(
            pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_rank=0
        )

    def get_hash_str(key: Any, prior_hash: Optional[str] = None, page_size: Optional[int] = None):
        """Stand-in for SGLang's native page hash: a sha256 chain over each page's tokens."""
        tokens = list(getattr(key, "token_ids", key))
        digest = bytes.fromhex(prior_hash) if prior_hash else b""
        if page_size is None:
            return hashlib.sha256(digest + repr(tokens).encode()).hexdigest()
        out = []
        for start in range(0, len(tokens), page_size):
            digest = hashlib.sha256(digest + repr(tokens[start : start + page_size]).encode())
            digest = digest.digest()
            out.append(digest.hex())
        return out

    _package("sglang")
    _module("sglang.srt.runtime_context", get_parallel=get_parallel)
    _module("sglang.srt.utils.network", NetworkAddress=NetworkAddress)
    kv_events = _exec_file("sglang.srt.disaggregation.kv_events", kv_events_path)
    helpers = real_functions(
        utils_path,
        [
            "storage_namespace_seed",
            "get_storage_hash_str",
            "hash_str_to_int64",
            "compute_node_hash_values",
            "compute_node_event_hash_values",
        ],
        {"Any": Any, "hashlib": hashlib, "get_hash_str": get_hash_str},
    )
    _module("sglang.srt.mem_cache.utils", **helpers)
    recorder = _exec_file("sglang.srt.mem_cache.events", recorder_path)
    return types.SimpleNamespace(kv_events=kv_events, recorder=recorder)
