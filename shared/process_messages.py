"""Process-control messages between batchserve's processes (`batchserve serve` and the systemd units): what the
worker can hold once loaded (`WorkerInfo`), liveness (`Heartbeat`) and a stalled backend (`BackendFailure`).
The request path's messages are `shared.messages`'."""

from __future__ import annotations

import msgspec

from batchserve.shared.step_features import StepShape


class WorkerInfo(msgspec.Struct, tag=True, kw_only=True):
    """worker -> scheduler once the model is loaded: what the KV pool and the model can hold."""

    kv_capacity_tokens: int
    eos_token_ids: list[int]
    max_context: int
    page_size: int
    device_type: str = "cpu"  # "cpu" | "cuda": picks the default step-time target
    # Steps timed at startup: (shape, seconds), for the step-cost model.
    step_costs: list[tuple[StepShape, float]] = []
    # A mixture-of-experts model's experts and experts per token (0 and 0: dense), for the step-cost model.
    moe_experts: int = 0
    moe_top_k: int = 0
    rope_switch_length: int = 0  # the prompt length past which the rope's factors switch (0: never)
    rope_dynamic_length: int = 0  # dynamic NTK: the prompt length past which its keys follow its length (0: never)
    sliding_window: int = 0  # every layer's attention window, where they share one (0: not so)
    # each layer's window for the step-cost model (0: none; empty: none slides or is linear): a linear-attention
    # layer's is the keys whose reads cost what its state's do (`shared.step_features.layer_cost_windows`)
    layer_windows: list[int] = []
    sliding_rings: bool = False  # sliding layers keep window-sized rings (`kernels.kv_cache`): no prefix cache
    # A hybrid model's linear layers' state bytes per request (`kernels.recurrent_state`; 0: none): a row
    # continues its slot's state, so no prefix cache and no speculative rows.
    recurrent_state_bytes: int = 0
    state_snapshots: int = 0  # the states it keeps for the prefix cache (0: none, and no prefix cache for it)
    pooling: bool = False  # the pooling runner: prefill-only requests, no prefix cache (SCHEDULING.md section 11)
    bidirectional: bool = False  # an encoder: each input runs whole in one step (no chunks)
    pid: int = 0  # the worker process (on the scheduler's machine): its end ends a step's wait at once
    weight_bytes: int = 0  # the model's weights as this rank holds them (procs.worker.weight_bytes): /metrics


# The five processes, in start order (`serve` and the systemd units): the slowest (model loading)
# first, the api last, so that it serves only when all the others are up.
PROCESS_NAMES = ("worker", "scheduler", "tokenizer", "detokenizer", "api")


class Heartbeat(msgspec.Struct, tag=True, kw_only=True):
    """every process -> api about once a second; the api is healthy only while all are fresh and ready."""

    process: str  # one of PROCESS_NAMES but "api", or a worker rank's `worker-RANK` (shared.parallel.worker_rank_name)
    pid: int
    ready: bool = True
    host: str = ""  # socket.gethostname(): where `pid` may be checked for liveness


class BackendFailure(msgspec.Struct, tag=True, kw_only=True):
    """scheduler -> api: `process` stopped making progress (e.g. no step result within the step
    timeout); the api fails every request in flight and answers 503 until the backend is restarted."""

    process: str
    reason: str
