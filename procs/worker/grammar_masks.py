"""`SlotGrammars`: each worker slot's grammar matcher (structured output), which masks the slot's
logits before sampling and is advanced by every token the slot samples.

The tokenizer process has already compiled and checked the grammar (`LogitsParams.grammar`); here a
pristine matcher per grammar text is kept (LRU) and copied per slot, so `n` choices or repeated
schemas build it once. Masks of all constrained rows are computed together on llguidance's threads
into one host bitmask, then applied on the device in one pass (`kernels.sampling.apply_token_bitmask_`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import llguidance
import numpy as np
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from kernels.sampling import apply_token_bitmask_

log = logging.getLogger("batchserve.worker")
PRISTINE_CACHE_SIZE = 64


class SlotGrammars:
    def __init__(self, num_slots: int, vocab_size: int, tokenizer: Callable[[], llguidance.LLTokenizer],
                 device: torch.device) -> None:
        self._make_tokenizer = tokenizer  # built by `prepare` or on the first grammar (~0.5 s for 50k tokens)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.device = device
        self.matchers: list[llguidance.LLMatcher | None] = [None] * num_slots
        self.active = np.zeros(num_slots, dtype=bool)
        self.pending = np.full(num_slots, -1, dtype=np.int64)  # the token after which the grammar starts
        self.bitmask = allocate_token_bitmask(num_slots, vocab_size)
        self._pristine: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def prepare(self) -> None:
        """Build the tokenizer now (a server does at startup); a tokenizer llguidance cannot read is
        logged, and the tokenizer process refuses structured output for it anyway."""
        try:
            self._ensure_tokenizer()
        except Exception as exc:
            log.info("structured output unavailable: llguidance cannot read this tokenizer (%s)", exc)

    def _ensure_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def start(self, slot: int, grammar: str | None, output_ids: list[int], *, after: int | None = None) -> None:
        """A request starts in `slot`; after a preemption its earlier tokens replay through the matcher.
        `after`: the grammar holds only from the token after this one (a thinking model's `</think>`)."""
        matcher = None if grammar is None else self._matcher(grammar)
        pending = -1
        if matcher is not None and after is not None:
            if after in output_ids:
                output_ids = output_ids[output_ids.index(after) + 1:]
            else:
                pending, output_ids = after, []
        if matcher is not None and output_ids and not matcher.consume_tokens(output_ids):
            log.warning("slot %d: replayed tokens do not match its grammar (%s); unconstrained from here",
                        slot, matcher.get_error())
            matcher = None
        self.matchers[slot] = matcher
        self.pending[slot] = pending if matcher is not None else -1
        self.active[slot] = matcher is not None and pending < 0

    def constrains(self, slots: np.ndarray) -> bool:
        """Some slot masks its logits, or waits for the token that starts its grammar."""
        return bool(self.active[slots].any() or (self.pending[slots] >= 0).any())

    def mask_(self, logits: torch.Tensor, slots: np.ndarray) -> None:
        """-inf for each constrained row's disallowed tokens (row i is `slots[i]`'s)."""
        rows = np.flatnonzero(self.active[slots])
        if not rows.shape[0]:
            return
        assert self._executor is not None  # made with the first matcher
        bitmask = self.bitmask[:rows.shape[0]]
        fill_next_token_bitmask_par(self._executor, [(self.matchers[s], i) for i, s in enumerate(slots[rows].tolist())],
                                    bitmask)
        host_mask = torch.from_numpy(bitmask)
        if rows.shape[0] == logits.shape[0]:
            apply_token_bitmask_(logits, host_mask)
            return
        index = torch.from_numpy(rows).to(self.device)
        scores = logits.index_select(0, index)
        apply_token_bitmask_(scores, host_mask)
        logits.index_copy_(0, index, scores)

    def accept(self, slots: np.ndarray, token_ids: list[int]) -> None:
        """Advance the constrained slots' matchers by the tokens they just sampled; start the grammars
        whose `after` token was just sampled."""
        pending = self.pending[slots]
        starting = slots[(pending >= 0) & (pending == np.asarray(token_ids))]
        for i in np.flatnonzero(self.active[slots]).tolist():
            slot = int(slots[i])
            matcher = self.matchers[slot]
            assert matcher is not None
            if matcher.is_stopped():  # done (EOS taken): an ignore_eos request runs on, unconstrained
                self.matchers[slot], self.active[slot] = None, False
            elif not matcher.consume_token(token_ids[i]):
                log.warning("slot %d: token %d rejected by its grammar (%s); unconstrained from here",
                            slot, token_ids[i], matcher.get_error())
                self.matchers[slot], self.active[slot] = None, False
        self.pending[starting], self.active[starting] = -1, True  # masked from the next token on

    def _matcher(self, grammar: str) -> llguidance.LLMatcher | None:
        pristine = self._pristine.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self._ensure_tokenizer(), grammar)
            if pristine.is_error():  # checked by the tokenizer process: only a mismatched tokenizer gets here
                log.error("grammar rejected in the worker: %s", pristine.get_error())
                return None
            self._pristine[grammar] = pristine
            if len(self._pristine) > PRISTINE_CACHE_SIZE:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(grammar)
        return pristine.deep_copy()
