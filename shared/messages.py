"""Messages exchanged between batchserve's processes.

Every message is a `msgspec.Struct`; on the wire they are msgpack. Bulk integer arrays are
`numpy.ndarray` fields: `shared.codec` turns them into bytes (or shared-memory references) on the way
out and back into arrays on the way in.

The scheduler <-> worker contract is `ForwardBatch` -> `StepResult`: the scheduler decides which
tokens run, where their KV goes and which pages each request slot owns; the worker only executes.
"""

from __future__ import annotations

import msgspec
import numpy as np


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request picks its next token. `temperature == 0` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed -> same tokens, whatever the batch


class StopParams(msgspec.Struct, frozen=True, kw_only=True):
    """When a request stops generating (checked by the scheduler, except `stop` strings)."""

    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: matched by the detokenizer


class ForwardBatch(msgspec.Struct, kw_only=True):
    """One model step, planned by the scheduler and executed by the worker.

    Requests appear in batch order; request i feeds `extend_lens[i]` tokens, which occupy the next
    `extend_lens[i]` entries of the packed arrays `input_ids`, `positions` and `kv_locs`.
    `kv_locs` are flat KV-pool indices (`page * page_size + offset`) where each token's K/V is written.
    `page_table_*` are page-table entries the worker must set before running:
    `page_table[page_table_slots[j], page_table_cols[j]] = page_table_pages[j]`.
    """

    step: int
    slots: list[int]  # request-table row of each request
    prefix_lens: list[int]  # tokens already in the KV cache before this step
    extend_lens: list[int]  # tokens fed this step (prefill chunk length, or 1 for a decode)
    samples: list[bool]  # False for an intermediate prefill chunk
    sampling: list[SamplingParams]
    sample_counts: list[int]  # tokens this request has sampled so far (advances seeded generators)
    input_ids: np.ndarray  # [num_tokens] int32
    positions: np.ndarray  # [num_tokens] int32
    kv_locs: np.ndarray  # [num_tokens] int32
    page_table_slots: np.ndarray  # [num_updates] int32
    page_table_cols: np.ndarray  # [num_updates] int32
    page_table_pages: np.ndarray  # [num_updates] int32

    @property
    def num_requests(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 and p > 0 for n, p in zip(self.extend_lens, self.prefix_lens))


class StepResult(msgspec.Struct, kw_only=True):
    """What the worker returns for a `ForwardBatch`: one token per request that samples, in batch order."""

    step: int
    next_token_ids: np.ndarray  # [num_sampling_requests] int32


# ---------------------------------------------------------------------------------------------
# Request path: api -> tokenizer -> scheduler -> detokenizer -> api.
# Tagged structs so one socket can carry a union (a request and its abort share a socket, so an
# abort can never overtake its request).


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class GenerateRequest(msgspec.Struct, tag=True, kw_only=True):
    """api -> tokenizer. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    rid: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # chat: the tokenizer applies the chat template
    sampling: SamplingParams = SamplingParams()
    stop: StopParams = StopParams()
    arrival_time: float = 0.0  # time.time() at the api
    # The client gave no max_tokens, so `stop.max_tokens` is the api's default (16 for completions,
    # max_context for chat): the tokenizer lowers it to `max_context - prompt_len` when it is
    # larger, instead of rejecting the request as too long.
    clamp_max_tokens: bool = False


class AbortRequest(msgspec.Struct, tag=True, kw_only=True):
    """Cancel `rid` wherever it is (api -> tokenizer -> scheduler)."""

    rid: str


class TokenizedRequest(msgspec.Struct, tag=True, kw_only=True):
    """tokenizer -> scheduler."""

    rid: str
    prompt_ids: np.ndarray  # [prompt_len] int32
    sampling: SamplingParams
    stop: StopParams
    arrival_time: float = 0.0


class RequestRejected(msgspec.Struct, tag=True, kw_only=True):
    """tokenizer or scheduler -> api: the request cannot run (HTTP 400 / 503)."""

    rid: str
    status: int  # HTTP status the api answers with
    message: str
    param: str | None = None


class TokenDelta(msgspec.Struct, tag=True, kw_only=True):
    """scheduler -> detokenizer: new tokens of one request (and its end, if `finish_reason` is set)."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total generated so far
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # Set on a request's first delta only, for the detokenizer's per-request state:
    stop: tuple[str, ...] = ()  # stop strings (StopParams.stop)
    prompt_tail: list[int] = []  # the prompt's last few ids: context for decoding the first tokens


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those whose KV came from the prefix cache


class TextDelta(msgspec.Struct, tag=True, kw_only=True):
    """detokenizer -> api: new text of one request; the last one carries `finish_reason` and `usage`."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    """scheduler -> api (for /metrics), sent after steps (at most every ~100 ms) and when idle."""

    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    batch_sizes: list[int] = []  # requests per step since the previous stats message
    # prefix cache: counters since the previous stats message, then the cache's size now
    cache_hit_tokens: int = 0
    cache_queried_tokens: int = 0
    cache_evicted_pages: int = 0
    cache_pages: int = 0
    cache_referenced_pages: int = 0
    preemptions: int = 0  # requests preempted since the previous stats message
    kv_reserve_ratio: float = 1.0  # the scheduler's configured ratio (SCHEDULING.md's rho)


# ---------------------------------------------------------------------------------------------
# Process control (`batchserve serve` and systemd units).


class WorkerInfo(msgspec.Struct, tag=True, kw_only=True):
    """worker -> scheduler once the model is loaded: what the KV pool and the model can hold."""

    kv_capacity_tokens: int
    eos_token_ids: list[int]
    max_context: int
    page_size: int


class Heartbeat(msgspec.Struct, tag=True, kw_only=True):
    """every process -> api about once a second; the api is healthy only while all are fresh and ready."""

    process: str  # "tokenizer" | "scheduler" | "worker" | "detokenizer"
    pid: int
    ready: bool = True
    host: str = ""  # socket.gethostname(): where `pid` may be checked for liveness


class BackendFailure(msgspec.Struct, tag=True, kw_only=True):
    """scheduler -> api: `process` stopped making progress (e.g. no step result within the step
    timeout); the api fails every request in flight and answers 503 until the backend is restarted."""

    process: str
    reason: str
