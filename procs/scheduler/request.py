"""One request as the scheduler sees it: the one record of a request from its arrival to its last
`TokenDelta` (its token-level numbers while admitted are mirrored in the request table's row)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec
import numpy as np

from batchserve.procs.scheduler.prefix_cache import CachedPage
from batchserve.shared.checks import MAX_TOKEN_ID
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import DEFAULT_PARAMS, PROMPT_TAIL_TOKENS, RequestParams, SlotStart, TokenLogprobs

NO_DRAFT = np.zeros(0, dtype=np.int32)
NO_DRAFT.flags.writeable = False


class Status(enum.Enum):
    """Where a request is in its life (SCHEDULING.md section 1b); the status says which of the
    scheduler's containers holds it: the waiting queue (WAITING, PREEMPTED), the mid-chunk list
    (PREFILLING), the decode set (RUNNING, until the step that reaches its token limit is launched),
    none once it has ended (FINISHED, CANCELLED)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"

    # Members are singletons: hash them by identity (in C) rather than by Enum's hash of the name (in
    # Python), which every move of every request paid twice.
    __hash__ = object.__hash__

    @property
    def holds_slot(self) -> bool:
        return self is Status.PREFILLING or self is Status.RUNNING

    @property
    def ended(self) -> bool:
        return self is Status.FINISHED or self is Status.CANCELLED


# SCHEDULING.md section 1b: the only moves a request makes.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.PREFILLING, Status.CANCELLED}),
    Status.PREFILLING: frozenset({Status.RUNNING, Status.PREEMPTED, Status.CANCELLED}),
    Status.RUNNING: frozenset({Status.FINISHED, Status.PREEMPTED, Status.CANCELLED}),
    Status.PREEMPTED: frozenset({Status.PREFILLING, Status.CANCELLED}),
    Status.FINISHED: frozenset(),
    Status.CANCELLED: frozenset(),
}


class Request:
    """`prompt` is what a (re-)admission prefills: the client's prompt, followed after a preemption by
    the tokens generated before it (SCHEDULING.md's recompute). `num_prompt_tokens` stays the client's.

    `draft`: tokens proposed to follow its last token (`Scheduler.set_draft`); its next decode row feeds
    them after the last token, one sampled position each, and uses them up.
    `status`: where it is in its life (`Status`), changed only by `move_to`.
    `reported`: tokens sent downstream in `TokenDelta`s so far, counted as its steps complete (0: its
    first delta is still to come); while it holds a slot the request table's `reported` column counts
    them, and its release copies the count here.
    `params`: what it asked for (`RequestParams`: sampling, stop, logits, priority, speculation), whole.
    `params.priority` (lower first) and `arrival` (its arrival's sequence number) order the waiting queue
    under the priority scheduling policy (SCHEDULING.md section 8).
    `spec_misses` / `spec_pause`: its proposals in a row with nothing accepted, and the steps it still
    skips for them (`procs.scheduler.speculation.ngram`); `draft_tokens` / `accepted_tokens`: its draft tokens so
    far and the accepted ones (its usage reports them)."""

    __slots__ = (
        "rid",
        "params",
        "status",
        "arrived_s",
        "prompt",
        "num_prompt_tokens",
        "slot",
        "prefilled",
        "first_admitted",
        "cache_path",
        "cached_tokens",
        "starting",
        "prompt_logprobs",
        "draft",
        "reported",
        "arrival",
        "spec_misses",
        "spec_pause",
        "draft_tokens",
        "accepted_tokens",
        "restore_state",
        "save_at",
    )

    def __init__(
        self, rid: str, prompt: np.ndarray, params: RequestParams = DEFAULT_PARAMS, *, arrival: int = 0
    ) -> None:
        self.rid = rid
        self.status = Status.WAITING
        self.arrived_s = 0.0  # the scheduler's clock at its arrival (its queue time is measured from it)
        self.prompt = prompt  # int32 [prompt_len]
        self.num_prompt_tokens = int(prompt.shape[0])
        self.params = params
        self.slot = -1  # request-table row once admitted
        self.prefilled = 0  # prompt tokens whose KV has been computed
        self.restore_state = -1  # a hybrid model's state snapshot its slot starts from (a cached prefix's)
        self.save_at: tuple[int, ...] = ()  # and where its prompt left the cached tree (`KVManager.lookup`)
        self.first_admitted = -1  # admission sequence number of its first admission; -1: never admitted
        self.cache_path: list[CachedPage] = []  # prefix-cache nodes it references (a path from the root)
        self.cached_tokens = 0  # prompt tokens its first admission found in the prefix cache
        self.starting = False  # admitted, its `SlotStart` not yet sent to the worker
        self.prompt_logprobs: list[TokenLogprobs] = []  # gathered chunk by chunk until its first token
        self.draft = NO_DRAFT
        self.reported = 0
        self.arrival = arrival
        self.spec_misses = 0
        self.spec_pause = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def move_to(self, status: Status) -> None:
        """The one place a request changes status; a move SCHEDULING.md 1b does not allow is a bug."""
        if status not in TRANSITIONS[self.status]:
            raise AssertionError(f"request {self.rid!r}: no move from {self.status.value} to {status.value}")
        self.status = status

    @property
    def queue_key(self) -> tuple[int, int]:
        """Its place in the waiting queue under the priority policy: priority, then arrival."""
        return self.params.priority, self.arrival

    @property
    def prompt_len(self) -> int:
        """Tokens a (re-)admission prefills."""
        return int(self.prompt.shape[0])

    @property
    def max_tokens(self) -> int:
        """Its token limit (settled by the tokenizer before the request reaches the scheduler)."""
        max_tokens = self.params.stop.max_tokens
        assert max_tokens is not None  # None only in a GenerateRequest the tokenizer has not yet settled
        return max_tokens

    @property
    def client_prompt(self) -> np.ndarray:
        return self.prompt[: self.num_prompt_tokens]

    @property
    def prompt_tail(self) -> list[int]:
        """The client's prompt's last few ids (the detokenizer's context for the first tokens)."""
        return self.client_prompt[-PROMPT_TAIL_TOKENS:].tolist()

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not yet delivered (they go out with the first token)."""
        return self.params.logits.prompt_logprobs is not None and self.num_generated_before == 0

    @property
    def num_generated_before(self) -> int:
        """Tokens generated before its last preemption (they are part of `prompt` now)."""
        return self.prompt_len - self.num_prompt_tokens

    def recompute_with(self, generated: np.ndarray) -> None:
        """Preempted: every token generated so far joins the prompt, prefilled again from the start."""
        self.move_to(Status.PREEMPTED)
        self.prompt = np.concatenate([self.client_prompt, generated.astype(np.int32)])
        self.prefilled = 0
        self.slot = -1
        self.prompt_logprobs = []
        self.draft = NO_DRAFT  # it followed the last token, which is a prompt token now

    def slot_start(self, eos_token_ids: tuple[int, ...]) -> SlotStart:
        """What the worker's slot needs to know of this request (its params, and the ids its logits need),
        sent once per admission."""
        params = self.params
        logits = params.logits
        if logits.is_plain:
            return SlotStart(
                slot=self.slot,
                params=params,
                prompt_len=self.prompt_len,
                client_prompt_len=self.num_prompt_tokens,
                restore_state=self.restore_state,
                adapter=params.adapter,
            )
        if logits.prompt_logprobs is not None and not self.wants_prompt_logprobs:
            logits = msgspec.structs.replace(logits, prompt_logprobs=None)  # sent before the preemption
            params = msgspec.structs.replace(params, logits=logits)
        needs_prompt = logits.repetition_penalty != 1.0 or logits.prompt_logprobs is not None
        n = self.num_prompt_tokens
        # The min_tokens ban: EOS (unless ignore_eos) and stop_token_ids.
        banned = [*(() if params.stop.ignore_eos else eos_token_ids), *params.stop.stop_token_ids]
        return SlotStart(
            slot=self.slot,
            params=params,
            prompt_len=self.prompt_len,
            client_prompt_len=self.num_prompt_tokens,
            prompt_ids=self.prompt[:n].tolist() if needs_prompt else [],
            output_ids=self.prompt[n:].tolist() if logits.needs_output_ids else [],
            min_tokens_banned=banned if logits.min_tokens else [],
            restore_state=self.restore_state,
            adapter=params.adapter,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.rid!r}, {self.status.value}, prompt_len={self.prompt_len}, "
            f"slot={self.slot}, prefilled={self.prefilled})"
        )


def prompt_array(prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A prompt as the scheduler keeps it (a fresh int32 array), or a `Refusal` naming `prompt`."""
    try:
        prompt = np.asarray(prompt_ids)
    except (TypeError, ValueError) as exc:
        raise Refusal(f"prompt token ids are not a sequence of integers ({exc})", "prompt") from None
    if prompt.ndim != 1:
        raise Refusal(f"prompt token ids must be one-dimensional, got shape {prompt.shape}", "prompt")
    if prompt.shape[0] == 0:
        raise Refusal("the prompt is empty", "prompt")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise Refusal(f"prompt token ids must be integers, got {prompt.dtype}", "prompt")
    if int(prompt.min()) < 0 or int(prompt.max()) > MAX_TOKEN_ID:
        raise Refusal("prompt token ids must be in [0, 2**31)", "prompt")
    return prompt.astype(np.int32, copy=True)


def check_runner(params: RequestParams, pooling: bool) -> None:
    """A `Refusal` for a request this server's runner does not answer (the api refuses it first, naming its
    endpoint): generation on the pooling runner, or pooling on the generate runner."""
    if params.pooling is not None and not pooling:
        raise Refusal("this server generates (--runner generate): it computes no embeddings", "model")
    if params.pooling is None and pooling:
        raise Refusal("this server pools (--runner pooling): it answers /v1/embeddings only, no generation", "model")
    if pooling and params.stop.max_tokens != 0:
        raise Refusal(
            "a pooling request generates no token (max_tokens 0): its one sampled row is its vector", "max_tokens"
        )
