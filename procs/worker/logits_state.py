"""`SlotLogitsState`: what each worker slot's request asked of its logits (`LogitsParams`), and the
per-token state that needs: generated-token counts, seen tokens, the bias row, the min_tokens ban.

It is set once when a request starts in a slot (`SlotStart`) and updated on the device by every
token the slot samples, so nothing but new tokens crosses the wire per step. The per-slot tables are
[slots, vocab] and allocated on first use: a server whose requests never ask pays nothing, and a
step whose rows are all plain skips this module after one numpy lookup. A structured-output
request's grammar (`SlotGrammars`) masks its row last, after every adjustment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from batchserve.kernels.sampling import apply_repetition_penalty_, token_logprobs
from batchserve.procs.worker.grammar_masks import SlotGrammars
from batchserve.procs.worker.sample_rows import SampleRows
from batchserve.shared.messages import PLAIN_LOGITS, LogitsParams, SlotStart, TokenLogprobs

BAN_BIAS = -100.0  # OpenAI: "values like -100 should result in a ban"; we make it exact (-inf)


class SlotLogitsState:
    def __init__(
        self, num_slots: int, vocab_size: int, device: torch.device, grammars: SlotGrammars | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.grammars = grammars  # None: structured output is not available (the tokenizer refuses it)
        self.device = device
        self.params: list[LogitsParams] = [PLAIN_LOGITS] * num_slots
        self.adjusting = np.zeros(num_slots, dtype=bool)  # any penalty, bias or min_tokens
        self.counting = np.zeros(num_slots, dtype=bool)  # penalties: count the sampled tokens
        self.logprobs_top = np.full(num_slots, -1, dtype=np.int64)  # -1: no logprobs
        self.prompts: list[np.ndarray | None] = [None] * num_slots  # prompt logprobs targets
        self.banned: list[torch.Tensor | None] = [None] * num_slots
        self._tables: _PenaltyTables | None = None

    # -- a request starts in a slot ----------------------------------------------------------------

    def start(self, start: SlotStart) -> None:
        s, params = start.slot, start.params.logits
        self.params[s] = params
        self.adjusting[s] = params.adjusts_logits
        self.counting[s] = params.penalizes
        self.logprobs_top[s] = -1 if params.logprobs is None else params.logprobs
        self.prompts[s] = np.asarray(start.prompt_ids, dtype=np.int64) if params.prompt_logprobs is not None else None
        self.banned[s] = (
            torch.tensor(start.min_tokens_banned, dtype=torch.long, device=self.device)
            if params.min_tokens and start.min_tokens_banned
            else None
        )
        if params.adjusts_logits:
            self._tables_for_use().reset(s, params, start.prompt_ids, start.output_ids)
        if self.grammars is not None:
            self.grammars.start(s, params.grammar, start.output_ids, after=params.grammar_after)

    def _tables_for_use(self) -> _PenaltyTables:
        if self._tables is None:
            self._tables = _PenaltyTables(len(self.params), self.vocab_size, self.device)
        return self._tables

    # -- each step ---------------------------------------------------------------------------------

    def adjust_(self, logits: torch.Tensor, rows: SampleRows) -> None:
        """Apply each sampled position's penalties, bias, min_tokens ban and grammar in place (logit
        row r is position r of `rows`)."""
        if rows.width > 1:
            self._adjust_positions_(logits, rows)
        else:
            self._adjust_(logits, rows.slots, rows.counts)
        if self.grammars is not None:
            self.grammars.mask_(logits, rows)

    def _adjust_positions_(self, logits: torch.Tensor, rows: SampleRows) -> None:
        """Rows of several positions, one round per position index j: before round j the proposed
        token d_j of each row that reaches j is counted, so position j sees the counts j single-token
        steps would have; the slots' counts are put back afterwards (`record` counts what is sampled)."""
        if not self.adjusting[rows.slots].any():
            return
        wide = rows.slots[rows.offsets == 1]  # the slot of each row of several positions
        counted = torch.from_numpy(wide[self.counting[wide]]).to(self.device)
        tables = self._tables
        with tables.kept(counted) if tables is not None and counted.shape[0] else contextlib.nullcontext():
            for j in range(rows.width):
                at = np.flatnonzero(rows.offsets == j)
                if j:
                    self._count(rows.slots[at], torch.from_numpy(rows.fed[at]).to(self.device))
                index = torch.from_numpy(at).to(self.device)
                scores = logits.index_select(0, index)
                self._adjust_(scores, rows.slots[at], rows.counts[at])
                logits.index_copy_(0, index, scores)

    def _adjust_(self, logits: torch.Tensor, slots: np.ndarray, sample_counts: np.ndarray) -> None:
        rows = np.flatnonzero(self.adjusting[slots])
        if not rows.shape[0]:
            return
        tables = self._tables
        assert tables is not None  # allocated by the first adjusting start
        whole = rows.shape[0] == logits.shape[0]
        row_index = None if whole else torch.from_numpy(rows).to(self.device)
        scores = logits if row_index is None else logits.index_select(0, row_index)
        row_slots = slots[rows]
        slot_index = torch.from_numpy(row_slots).to(self.device)
        repeating = self.counting[row_slots] & (tables.repetition_host[row_slots] != 1.0)
        if repeating.all():
            apply_repetition_penalty_(
                scores, tables.seen.index_select(0, slot_index), tables.repetition.index_select(0, slot_index)
            )
        elif repeating.any():
            rep_rows = torch.from_numpy(np.flatnonzero(repeating)).to(self.device)
            sub = scores.index_select(0, rep_rows)
            apply_repetition_penalty_(
                sub,
                tables.seen.index_select(0, slot_index[rep_rows]),
                tables.repetition.index_select(0, slot_index[rep_rows]),
            )
            scores.index_copy_(0, rep_rows, sub)
        scores.add_(tables.additive.index_select(0, slot_index))
        for i, s in enumerate(row_slots.tolist()):
            banned = self.banned[s]
            if banned is not None and sample_counts[rows[i]] < self.params[s].min_tokens:
                scores[i].index_fill_(0, banned, float("-inf"))
        if row_index is not None:
            logits.index_copy_(0, row_index, scores)

    def record(self, rows: SampleRows, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled (position r's by `rows.slots[r]`) for the slots with
        penalties, a row's in order; advance grammars by them."""
        slots = rows.slots
        if self.grammars is not None and self.grammars.constrains(slots):
            self.grammars.accept(slots, token_ids.tolist())
        if rows.width == 1:
            self._count(slots, token_ids)
            return
        for j in range(rows.width):  # one position per slot at a time, as single-token steps count
            at = np.flatnonzero(rows.offsets == j)
            self._count(slots[at], token_ids.index_select(0, torch.from_numpy(at).to(self.device)))

    def _count(self, slots: np.ndarray, token_ids: torch.Tensor) -> None:
        """Count `token_ids[i]` for `slots[i]` (distinct slots) where the slot has penalties."""
        rows = np.flatnonzero(self.counting[slots])
        if rows.shape[0] and self._tables is not None:
            index = torch.from_numpy(rows).to(self.device)
            self._tables.count(torch.from_numpy(slots[rows]).to(self.device), token_ids.index_select(0, index))

    def logprob_rows(self, slots: np.ndarray) -> np.ndarray:
        """The sampled positions (whose slots these are) that asked for logprobs."""
        return np.flatnonzero(self.logprobs_top[slots] >= 0)

    def sampled_logprobs(
        self, logprobs: torch.Tensor, token_ids: torch.Tensor, slots: np.ndarray
    ) -> list[TokenLogprobs]:
        return token_logprobs(logprobs, token_ids, self.logprobs_top[slots].tolist())

    # -- prompt logprobs ---------------------------------------------------------------------------

    @property
    def wants_prompt_logprobs(self) -> bool:
        return any(p is not None for p in self.prompts)

    def prompt_logprob_chunks(
        self, slots: list[int], prefix_lens: list[int], extend_lens: list[int]
    ) -> list[tuple[int, range, np.ndarray]]:
        """(slot, prompt positions, packed token rows) of a step's prefill chunks that want prompt logprobs."""
        if not self.wants_prompt_logprobs:
            return []
        chunks = []
        row = 0
        for slot, start, length in zip(slots, prefix_lens, extend_lens):
            positions = self.prompt_logprob_positions(slot, start, length)
            if len(positions):
                chunks.append((slot, positions, np.arange(row, row + len(positions), dtype=np.int64)))
            row += length
        return chunks

    def chunks_prompt_logprobs(
        self, chunks: list[tuple[int, range, np.ndarray]], logits: torch.Tensor
    ) -> list[tuple[int, list[TokenLogprobs]]]:
        """The prompt logprobs of `prompt_logprob_chunks`' chunks from their rows' logits, in order."""
        out = []
        row = 0
        for slot, positions, _ in chunks:
            logprobs = torch.log_softmax(logits[row : row + len(positions)], dim=-1)
            out.append((slot, self.prompt_logprobs(slot, positions, logprobs)))
            row += len(positions)
        return out

    def prompt_logprob_positions(self, slot: int, start: int, length: int) -> range:
        """Positions of a prefill chunk [start, start + length) whose logits predict a prompt token
        (every one but the prompt's last, which predicts the first generated token)."""
        prompt = self.prompts[slot]
        if prompt is None:
            return range(0)
        return range(start, min(start + length, prompt.shape[0] - 1))

    def prompt_logprobs(self, slot: int, positions: range, logprobs: torch.Tensor) -> list[TokenLogprobs]:
        prompt = self.prompts[slot]
        assert prompt is not None
        targets = torch.from_numpy(prompt[positions.start + 1 : positions.stop + 1]).to(self.device)
        top = self.params[slot].prompt_logprobs or 0
        if positions.stop == prompt.shape[0] - 1:
            self.prompts[slot] = None  # every prompt token has its logprob: later steps need not look
        return token_logprobs(logprobs, targets, [top] * len(positions))


class _PenaltyTables:
    """The [slots, vocab] tables of the slots that adjust their logits.

    `additive[s]` = logit_bias - frequency * count - presence * (count > 0), kept current as tokens
    are counted, so applying bias and both OpenAI penalties is one gather and one add per step."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.additive = torch.zeros(num_slots, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)  # prompt or output
        self.repetition = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.repetition_host = np.ones(num_slots, dtype=np.float32)
        self.frequency = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.presence = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.device = device

    def reset(self, s: int, params: LogitsParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        device = self.device
        self.repetition[s] = params.repetition_penalty
        self.repetition_host[s] = params.repetition_penalty
        self.frequency[s] = params.frequency_penalty
        self.presence[s] = params.presence_penalty
        additive = self.additive[s]
        additive.zero_()
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
            additive.index_copy_(0, ids, bias.masked_fill(bias <= BAN_BIAS, float("-inf")))
        counts = self.counts[s]
        counts.zero_()
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.long, device=device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            additive.sub_(params.frequency_penalty * counts + params.presence_penalty * (counts > 0))
        seen = self.seen[s]
        seen.copy_(counts > 0)
        if prompt_ids:
            seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """One sampled token per slot (slots distinct): counts, seen and the additive row follow."""
        new = self.counts[slots, tokens] + 1
        self.counts[slots, tokens] = new
        self.seen[slots, tokens] = True
        self.additive[slots, tokens] -= self.frequency[slots] + self.presence[slots] * (new == 1)

    @contextlib.contextmanager
    def kept(self, slots: torch.Tensor) -> Iterator[None]:
        """The slots' counts, additive and seen rows as they are now, put back on leaving."""
        counts, additive, seen = self.counts[slots], self.additive[slots], self.seen[slots]
        try:
            yield
        finally:
            self.counts[slots] = counts
            self.additive[slots] = additive
            self.seen[slots] = seen
