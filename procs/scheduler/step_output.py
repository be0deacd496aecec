"""What a step did (`StepOutput`), a step between its launch and its completion (`LaunchedStep`), and the
tokens of a completed step that count (`KeptTokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np

from batchserve.procs.scheduler.batch import StepPlan
from batchserve.procs.scheduler.request import Request
from batchserve.shared.messages import ForwardBatch, TokenLogprobs


class StepOutput(msgspec.Struct, kw_only=True):
    """What one step did. `cancelled`: requests aborted since the previous step (already freed)."""

    step: int
    prefill: list[tuple[str, int]] = []  # (rid, prompt tokens processed), batch order
    decode: list[str] = []  # admission order
    finished: list[str] = []
    cancelled: list[str] = []
    new_tokens: list[tuple[str, int]] = []  # (rid, token id), batch order; stop tokens included
    token_counts: list[int] = []  # for each of new_tokens: its request's tokens so far, that one included
    finish_reasons: dict[str, str] = {}  # rid -> "stop" | "length"
    batch_size: int = 0  # requests in the executed batch; 0: idle step
    preempted: list[str] = []  # back in the waiting queue (for a higher-priority head, then step 3b), in order
    logprobs: dict[str, list[TokenLogprobs]] = {}  # rid -> its new tokens' logprobs (requests that asked)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}  # rid -> prompt tokens 1.., with its first token
    # rid -> the record of each request this output finishes or cancels (forgotten by the scheduler;
    # its final `TokenDelta` still reads it)
    ended: dict[str, Request] = {}
    # Speculative decoding: (rid, draft tokens, those verification accepted) of each row that carried a
    # draft, batch order (rows of requests that ended while the step ran left out).
    drafted: list[tuple[str, int, int]] = []
    # The step-time bound (SCHEDULING.md 6.5): the prompt tokens its cap allowed this step (None: no
    # bound, or out of reach) and the step's predicted seconds (None: no cost model).
    prefill_cap: int | None = None
    predicted_s: float | None = None
    queue_times: list[float] = []  # seconds waited by each request this step admitted for the first time
    pooled: dict[str, bytes] = {}  # the pooling runner: rid -> its vector (float32 bytes), in place of its token
    # Cancelled because their output constraint failed (`StepResult.grammar_failures`): rid -> (error, field)
    errors: dict[str, tuple[str, str | None]] = {}

    @property
    def draft_tokens(self) -> int:
        return sum(n for _, n, _ in self.drafted)

    @property
    def accepted_tokens(self) -> int:
        return sum(a for _, _, a in self.drafted)


_NO_ROWS = np.zeros(0, dtype=np.int64)


class LaunchedStep(NamedTuple):
    """A step between `Scheduler.launch` and `Scheduler.complete`: its plan and batch (None: nothing
    to run), what it did so far, and for each sampling row in batch order the slot, request, index of
    its first token in the request's output, tokens it samples, and the admission that launched it."""

    plan: StepPlan
    batch: ForwardBatch | None
    out: StepOutput
    sample_slots: np.ndarray = _NO_ROWS
    sample_rids: list[str] = []
    token_index: np.ndarray = _NO_ROWS
    sample_lens: np.ndarray = _NO_ROWS
    admit_seq: np.ndarray = _NO_ROWS
    completing: list[Request] = []


@dataclass(frozen=True, slots=True)  # not a NamedTuple: its field `index` would hide tuple.index
class KeptTokens:
    """A completed step's tokens that count (batch order): slot, index in the request's output, id and
    rid of each, whether it is a stop token, whether it ends its request, and where each stands in
    `StepResult.next_token_ids` (None: every token counts)."""

    slots: np.ndarray
    index: np.ndarray
    token_ids: np.ndarray
    rids: list[str]
    stopped: np.ndarray
    ends: np.ndarray
    positions: np.ndarray | None
