"""`SlotGrammars`: each worker slot's grammar matcher (structured output), which masks the slot's
logits before sampling and is advanced by every token the slot samples.

A decode row of several positions (`SampleRows`) is masked at position j as if its proposed tokens
d1 .. dj had been accepted (llguidance computes those masks from the proposals and rolls its matcher
back), and the matcher then advances by every token the row returns, in order: the scheduler keeps
them all. Where a sampled token differs from the proposal after it, the later positions were masked
after a proposal that was not generated; speculative decoding, which drops those tokens, must roll
the matcher back to the kept ones (`LLMatcher.rollback`).

The tokenizer process has already compiled and checked the grammar (`LogitsParams.grammar`); here a
pristine matcher per grammar text is kept (LRU) and copied per slot, so `n` choices or repeated
schemas build it once. Masks of all constrained rows are computed together on llguidance's threads
into one host bitmask, then applied on the device in one pass (`kernels.sampling.apply_token_bitmask_`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import numpy as np
import torch
from llguidance.numpy import (
    allocate_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from batchserve.kernels.sampling import apply_token_bitmask_
from batchserve.procs.worker.sample_rows import SampleRows

log = logging.getLogger("batchserve.worker")
PRISTINE_CACHE_SIZE = 64


class SlotGrammars:
    def __init__(
        self, num_slots: int, vocab_size: int, tokenizer: Callable[[], llguidance.LLTokenizer], device: torch.device
    ) -> None:
        self._make_tokenizer = tokenizer  # built by `prepare` or on the first grammar (slow: once)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.device = device
        self.vocab_size = vocab_size
        self.matchers: list[llguidance.LLMatcher | None] = [None] * num_slots
        self.active = np.zeros(num_slots, dtype=bool)
        self.pending = np.full(num_slots, -1, dtype=np.int64)  # the token after which the grammar starts
        self.bitmask = allocate_token_bitmask(num_slots, vocab_size)
        self._pristine: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.failures: list[tuple[int, str]] = []  # (slot, error) since `take_failures`

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
                output_ids = output_ids[output_ids.index(after) + 1 :]
            else:
                pending, output_ids = after, []
        if matcher is not None and output_ids and not matcher.consume_tokens(output_ids):
            self._fail(slot, f"the replayed tokens do not match the grammar: {matcher.get_error()}")
            matcher = None
        self.matchers[slot] = matcher
        self.pending[slot] = pending if matcher is not None else -1
        self.active[slot] = matcher is not None and pending < 0

    def constrains(self, slots: np.ndarray) -> bool:
        """Some slot masks its logits, or waits for the token that starts its grammar."""
        return bool(self.active[slots].any() or (self.pending[slots] >= 0).any())

    def mask_(self, logits: torch.Tensor, rows: SampleRows) -> None:
        """-inf for each constrained position's disallowed tokens (logit row r is position r of `rows`)."""
        runs = self._runs(rows)
        if not runs:
            return
        assert self._executor is not None  # made with the first matcher
        positions: list[int] = []
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        for matcher, first, proposed in runs:
            if proposed:
                drafted.append((matcher, len(positions), proposed))
            else:
                plain.append((matcher, len(positions)))
            positions.extend(range(first, first + 1 + len(proposed)))
        bitmask = self._bitmask(len(positions))
        if drafted:
            bitmask[:] = -1  # positions after a proposal the grammar rejects, or after its end: unconstrained
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        host_mask = torch.from_numpy(bitmask)
        if len(positions) == logits.shape[0]:
            apply_token_bitmask_(logits, host_mask)
            return
        index = torch.tensor(positions, dtype=torch.int64).to(self.device)
        scores = logits.index_select(0, index)
        apply_token_bitmask_(scores, host_mask)
        logits.index_copy_(0, index, scores)

    def _runs(self, rows: SampleRows) -> list[tuple[llguidance.LLMatcher, int, list[int]]]:
        """(matcher, first position, the proposed tokens after it) of each run of positions a grammar
        masks: an active slot's whole row; for a slot waiting for its `after` token, the positions
        after it where it is one of the row's proposed tokens."""
        row_slots = rows.slots[rows.firsts]
        constrained = np.flatnonzero(self.active[row_slots] | (self.pending[row_slots] >= 0))
        runs = []
        for r in constrained.tolist():
            slot, first, length = int(row_slots[r]), int(rows.firsts[r]), int(rows.lens[r])
            proposed = rows.proposed(first, length) if length > 1 else []
            matcher = self.matchers[slot]
            assert matcher is not None
            if self.active[slot]:
                runs.append((matcher, first, proposed))
            elif self.pending[slot] in proposed:
                start = proposed.index(int(self.pending[slot])) + 1
                runs.append((matcher, first + start, proposed[start:]))
        return runs

    def _bitmask(self, rows: int) -> np.ndarray:
        if rows > self.bitmask.shape[0]:  # rows of several positions: more than one mask per slot
            self.bitmask = allocate_token_bitmask(rows, self.vocab_size)
        return self.bitmask[:rows]

    def accept(self, slots: np.ndarray, token_ids: list[int]) -> None:
        """Advance the constrained slots' matchers by the tokens just sampled (token i by `slots[i]`,
        a row's in order); start the grammars whose `after` token was sampled."""
        for i in np.flatnonzero(self.active[slots] | (self.pending[slots] >= 0)).tolist():
            self._advance(int(slots[i]), token_ids[i])

    def _advance(self, slot: int, token: int) -> None:
        if self.pending[slot] >= 0:
            if token == self.pending[slot]:
                self.pending[slot], self.active[slot] = -1, True  # masked from the next token on
            return
        if not self.active[slot]:  # unconstrained by an earlier token of the same row
            return
        matcher = self.matchers[slot]
        assert matcher is not None
        if matcher.is_stopped():  # done (EOS taken): an ignore_eos request runs on, unconstrained
            self.matchers[slot], self.active[slot] = None, False
        elif not matcher.consume_token(token):
            self._fail(slot, matcher.get_error() or f"token {token} was rejected")
            self.matchers[slot], self.active[slot] = None, False

    def _fail(self, slot: int, error: str) -> None:
        """The slot's grammar cannot go on: its request is ended with an error (the scheduler, from the
        step's `grammar_failures`), never left to run unconstrained."""
        log.info("slot %d: its grammar failed (%s); the request ends with an error", slot, error)
        self.failures.append((slot, error))

    def take_failures(self) -> list[tuple[int, str]]:
        failures, self.failures = self.failures, []
        return failures

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
