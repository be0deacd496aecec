"""`SampleRows`: the positions one step samples, one logit row each, in batch order.

Row i of a `ForwardBatch` samples the logits of its last `sample_lens[i]` fed tokens. A decode row
of k tokens feeds [its last token, d1 .. d(k-1)] (d: proposed tokens); its position j samples the
token after its j-th input, so for position j the proposed tokens d1 .. dj count as generated: the
j-th position counts as `sample_counts[i] + j`, and the slot's penalty counts and grammar see d1 .. dj
(`SlotLogitsState.adjust_`, `SlotGrammars.mask_`). With one position per row, k = 1, nothing is
proposed and each position is its row.

Speculative decoding verifies a proposal by these positions (`accepted`, the rule of
`shared.verification`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchserve.shared.messages import ForwardBatch
from batchserve.shared.ranges import concat_ranges
from batchserve.shared.verification import accepted_lengths


def sampled_tokens(extend_lens: list[int], sample_lens: list[int]) -> np.ndarray:
    """Each sampled position's index into the batch's packed tokens (its row's last sample_len ones)."""
    lens = np.asarray(sample_lens, dtype=np.int64)
    ends = np.cumsum(np.asarray(extend_lens, dtype=np.int64))
    return concat_ranges(ends - lens, lens)


@dataclass(frozen=True)
class SampleRows:
    """One step's sampled positions, in logit-row order (see the module's docstring)."""

    slots: np.ndarray  # [m] int64: each position's slot (a row of k positions repeats its slot k times)
    counts: np.ndarray  # [m] int64: the tokens its request sampled before this position
    offsets: np.ndarray  # [m] int64: j, the position's index within its row
    fed: np.ndarray  # [m] int64: the token fed at this position (the position samples the one after it)
    firsts: np.ndarray  # [rows] int64: the first position of each row that samples
    lens: np.ndarray  # [rows] int64: its number of positions

    @classmethod
    def of_batch(cls, batch: ForwardBatch) -> SampleRows:
        """The batch's sampled positions (its FUTURE_TOKEN inputs already filled)."""
        lens = np.asarray(batch.sample_lens, dtype=np.int64)
        sampling = np.flatnonzero(lens)
        fed = batch.input_ids[sampled_tokens(batch.extend_lens, batch.sample_lens)]
        return cls.build(
            np.asarray(batch.slots, dtype=np.int64)[sampling],
            np.asarray(batch.sample_counts, dtype=np.int64)[sampling],
            lens[sampling],
            fed,
        )

    @classmethod
    def build(cls, slots: np.ndarray, counts: np.ndarray, lens: np.ndarray, fed: np.ndarray) -> SampleRows:
        """From each sampling row's slot, sample count and positions (`lens`, >= 1), and the token fed
        at each position."""
        offsets = concat_ranges(0, lens)
        return cls(
            slots=np.repeat(slots, lens),
            counts=np.repeat(counts, lens) + offsets,
            offsets=offsets,
            fed=np.asarray(fed, dtype=np.int64),
            firsts=np.cumsum(lens) - lens,
            lens=lens,
        )

    @property
    def width(self) -> int:
        """The most positions of one row (1: nothing proposed)."""
        return int(self.lens.max()) if self.lens.shape[0] else 0

    def proposed(self, first: int, length: int) -> list[int]:
        """The proposed tokens of the row whose positions are first .. first + length - 1."""
        return self.fed[first + 1 : first + length].tolist()

    def accepted(self, token_ids: np.ndarray) -> np.ndarray:
        """[rows] how many of each row's positions are kept (1 .. lens): its first, then each next one
        while the token sampled before it is the token proposed there (`shared.verification`)."""
        if self.width <= 1:
            return self.lens
        return accepted_lengths(np.asarray(token_ids), self.fed, self.firsts, self.lens)

    def kept(self, accepted: np.ndarray) -> tuple[SampleRows, np.ndarray]:
        """The rows cut to their `accepted` positions, and those positions' indices in these rows."""
        index = np.flatnonzero(self.offsets < np.repeat(accepted, self.lens))
        return SampleRows.build(self.slots[self.firsts], self.counts[self.firsts], accepted, self.fed[index]), index
