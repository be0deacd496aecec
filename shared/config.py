"""One `ServerConfig`, filled from CLI flags and `BATCHSERVE_*` environment variables, given to every process.

Each field has a CLI flag (`--page-size`) and an environment variable (`BATCHSERVE_PAGE_SIZE`);
a flag given on the command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

# The scheduler's batch-forming policies (procs/scheduler/managers.py implements each).
Policy = Literal["prefill-first", "mixed", "fixed"]
POLICIES: tuple[str, ...] = get_args(Policy)
DEFAULT_MODEL = "smollm2-135m-instruct"


class ServerConfig(msgspec.Struct, kw_only=True):
    # model
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    max_context: int = 0  # 0: the model's own context length
    # KV cache
    page_size: int = 16
    kv_capacity_tokens: int = 0  # 0: derived from kv_memory_gb
    kv_memory_gb: float = 0.0  # 0: on CUDA kv_memory_fraction of the memory free after the weights; CPU 1 GiB
    kv_memory_fraction: float = 0.85  # of free device memory, as the peers' defaults leave headroom
    # scheduler
    policy: Policy = "mixed"
    max_running_requests: int = 64
    prefill_budget: int = 2048
    max_waiting: int = 1024
    # Share of each request's remaining max_tokens reserved at admission (SCHEDULING.md's rho; whole
    # percents). Chosen by measurement: loadtests/results/reserve_ratio_cpu.txt, README "Admission".
    kv_reserve_ratio: float = 0.05
    disable_prefix_cache: bool = False  # by default requests share the KV of common prompt prefixes
    # Steps carrying prefill are sized (by a step-cost model) to take at most this long, which bounds
    # the inter-token latency of everyone decoding beside them; prefill_budget stays the hard cap.
    # -1: no time bound (the default for now: on a 2-core CPU the 300 ms target halved p99 ITL but cost
    # 9 % throughput and 3.5x median TTFT, loadtests/results/step_time_bound_cpu.txt); 0: the device's
    # suggested target (CPU 300 ms, CUDA 100 ms).
    max_step_ms: float = -1.0
    # A step without a result for this long fails every request in flight and stops the scheduler
    # (a hung or dead worker); generous, since a long prefill chunk on a CPU takes seconds.
    step_timeout_s: float = 30.0
    # worker
    attention_backend: str = "auto"  # auto | cpu | torch | flashinfer
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 0  # 0: max_running_requests
    # api
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""  # "": the model argument
    api_key: list[str] = []  # required as `Authorization: Bearer <key>` on /v1/*; none: no authentication
    api_key_file: str = ""  # one key per line (blank lines and # comments skipped)
    header_timeout_s: float = 10.0  # to send a request's headers, and how long an idle keep-alive lasts
    body_timeout_s: float = 60.0  # to send a request's body
    max_connections: int = 10000  # open HTTP connections; more are answered 503 at once
    # processes
    runtime_dir: str = ""  # "": $RUNTIME_DIRECTORY or a fresh temporary directory
    log_format: Literal["text", "json"] = "text"
    drain_timeout_s: float = 30.0

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> "ServerConfig":
        return msgspec.json.decode(data, type=cls)

    @classmethod
    def load(cls, path: str | Path) -> "ServerConfig":
        return cls.from_json(Path(path).read_bytes())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_default(field: msgspec.structs.FieldInfo) -> Any:
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


def add_config_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Add one CLI flag per `ServerConfig` field (or per field in `only`); defaults stay unset.
    A list field's flag is repeatable."""
    for field in msgspec.structs.fields(ServerConfig):
        if only is not None and field.name not in only:
            continue
        default = field_default(field)
        help_text = f"(default: {default!r}; env BATCHSERVE_{field.name.upper()})"
        if isinstance(default, bool):
            parser.add_argument(_flag(field.name), dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        elif isinstance(default, list):
            parser.add_argument(_flag(field.name), dest=field.name, action="append", default=None,
                                help=f"repeatable {help_text}, comma-separated")
        else:
            parser.add_argument(_flag(field.name), dest=field.name, type=type(default), default=None, help=help_text)


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None, **overrides: Any) -> ServerConfig:
    """Defaults < `BATCHSERVE_*` environment < CLI flags < explicit overrides. Bad values raise ValueError."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(ServerConfig):
        raw = env.get(f"BATCHSERVE_{field.name.upper()}")
        if raw is not None and raw != "":
            values[field.name] = _parse_env(field.name, raw, field_default(field))
        cli = getattr(args, field.name, None)
        if cli is not None:
            values[field.name] = cli
    values.update(overrides)
    try:
        return msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad configuration: {exc}") from None


def _parse_env(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"BATCHSERVE_{name.upper()}: expected a boolean, got {raw!r}")
    if isinstance(default, list):
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"BATCHSERVE_{name.upper()}: expected {type(default).__name__}, got {raw!r}") from None


def cache_dir() -> Path:
    """Where converted models and downloaded wheels live (`BATCHSERVE_CACHE`, default ~/.cache/batchserve)."""
    return Path(os.environ.get("BATCHSERVE_CACHE") or Path.home() / ".cache" / "batchserve")
