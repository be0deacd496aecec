"""Packed integer ranges: a step's rows lie one after another in its packed arrays (tokens, positions,
page-table columns), and each row's indices are a range. One function, for every process that packs."""

from __future__ import annotations

import numpy as np


def concat_ranges(starts: np.ndarray | int, counts: np.ndarray) -> np.ndarray:
    """starts[i] .. starts[i] + counts[i] - 1 for every i, concatenated (int64); `starts` may be one number."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.broadcast_to(np.asarray(starts, dtype=np.int64), counts.shape)
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
