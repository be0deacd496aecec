"""Which of `ServerConfig`'s settings are the engine's, and which belong to the server around it.

The server's alone (`SERVER_ONLY_FIELDS`): the HTTP api, the replicas and their router, the five
processes (sockets, logs, drain), overlap scheduling (the scheduler process pipelining steps to the
worker process; the offline engine runs one step at a time in one process), and what shapes a server's
clients' experience, the step-time bound and the waiting limit (offline every prompt is in at once and
only throughput counts). Every other field is an engine setting, which `batchserve generate` takes as
`serve` does (`shared.config.ENGINE_FIELDS`): a new field is one unless named here.
"""

from __future__ import annotations

from collections.abc import Sequence

SERVER_ONLY_FIELDS: frozenset[str] = frozenset(
    {
        "host",
        "port",
        "served_model_name",
        "api_key",
        "api_key_file",
        "webui",
        "header_timeout_s",
        "body_timeout_s",
        "max_connections",
        "responses_store",
        "responses_ttl_s",
        "data_parallel_size",
        "data_parallel_rank",
        "router",
        "router_policy",
        "router_args",
        "runtime_dir",
        "log_format",
        "drain_timeout_s",
        "overlap_schedule",
        "max_step_ms",
        "min_prefill_share",
        "max_waiting",
        "enable_lora_runtime_updates",
    }
)


def engine_fields(fields: Sequence[str]) -> tuple[str, ...]:
    """The engine's settings among `fields` (`ServerConfig`'s, in order): all but the server's alone.
    TypeError where `SERVER_ONLY_FIELDS` names no field of them: a renamed field would silently become
    an engine flag."""
    unknown = SERVER_ONLY_FIELDS - set(fields)
    if unknown:
        raise TypeError(f"SERVER_ONLY_FIELDS names no ServerConfig field: {sorted(unknown)}")
    return tuple(name for name in fields if name not in SERVER_ONLY_FIELDS)
