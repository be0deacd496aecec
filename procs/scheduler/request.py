"""One request as the scheduler sees it (token-level state lives in the request table's row)."""

from __future__ import annotations

import msgspec
import numpy as np

from procs.scheduler.prefix_cache import CachedPage
from shared.messages import PLAIN_LOGITS, LogitsParams, SamplingParams, SlotStart, StopParams, TokenLogprobs


class Request:
    """`prompt` is what a (re-)admission prefills: the client's prompt, followed after a preemption by
    the tokens generated before it (SCHEDULING.md's recompute). `num_prompt_tokens` stays the client's."""

    __slots__ = ("rid", "prompt", "prompt_len", "num_prompt_tokens", "sampling", "stop", "max_tokens", "stop_ids",
                 "slot", "prefilled", "first_admitted", "cache_path", "cached_tokens", "logits", "min_tokens_banned", "starting", "prompt_logprobs")

    def __init__(self, rid: str, prompt: np.ndarray, sampling: SamplingParams, stop: StopParams,
                 logits: LogitsParams = PLAIN_LOGITS, min_tokens_banned: tuple[int, ...] = ()) -> None:
        self.rid = rid
        self.prompt = prompt  # int32 [prompt_len]
        self.prompt_len = int(prompt.shape[0])
        self.num_prompt_tokens = self.prompt_len
        self.sampling = sampling
        self.stop = stop
        self.max_tokens = stop.max_tokens
        self.stop_ids = frozenset(stop.stop_token_ids)
        self.slot = -1  # request-table row once admitted
        self.prefilled = 0  # prompt tokens whose KV has been computed
        self.first_admitted = -1  # admission sequence number of its first admission; -1: never admitted
        self.cache_path: list[CachedPage] = []  # prefix-cache nodes it references (a path from the root)
        self.cached_tokens = 0  # prompt tokens its first admission found in the prefix cache
        self.logits = logits
        self.min_tokens_banned = min_tokens_banned  # EOS (unless ignore_eos) and stop_token_ids
        self.starting = False  # admitted, its `SlotStart` not yet sent to the worker
        self.prompt_logprobs: list[TokenLogprobs] = []  # gathered chunk by chunk until its first token

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not yet delivered (they go out with the first token)."""
        return self.logits.prompt_logprobs is not None and self.num_generated_before == 0

    @property
    def num_generated_before(self) -> int:
        """Tokens generated before its last preemption (they are part of `prompt` now)."""
        return self.prompt_len - self.num_prompt_tokens

    def recompute_with(self, generated: np.ndarray) -> None:
        """Preempted: every token generated so far joins the prompt, prefilled again from the start."""
        self.prompt = np.concatenate([self.prompt[:self.num_prompt_tokens], generated.astype(np.int32)])
        self.prompt_len = int(self.prompt.shape[0])
        self.prefilled = 0
        self.slot = -1
        self.prompt_logprobs = []

    def slot_start(self) -> SlotStart:
        """What the worker's slot needs to know of this request's logits, sent once per admission."""
        logits = self.logits
        if logits.is_plain:
            return SlotStart(slot=self.slot)
        if logits.prompt_logprobs is not None and not self.wants_prompt_logprobs:
            logits = msgspec.structs.replace(logits, prompt_logprobs=None)  # sent before the preemption
        needs_prompt = logits.repetition_penalty != 1.0 or logits.prompt_logprobs is not None
        n = self.num_prompt_tokens
        return SlotStart(slot=self.slot, logits=logits,
                         prompt_ids=self.prompt[:n].tolist() if needs_prompt else [],
                         output_ids=self.prompt[n:].tolist() if logits.needs_output_ids else [],
                         min_tokens_banned=list(self.min_tokens_banned) if logits.min_tokens else [])

    def __repr__(self) -> str:
        return f"Request({self.rid!r}, prompt_len={self.prompt_len}, slot={self.slot}, prefilled={self.prefilled})"
