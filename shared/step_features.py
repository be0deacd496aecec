"""What a step's time depends on, measured the same way where steps are timed (the worker's startup
probe) and where they are planned (the scheduler's step-cost model)."""

from __future__ import annotations

from collections.abc import Sequence


def attention_pairs(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
    """Query-key pairs attention computes: a request feeding n tokens after p cached ones pairs its
    i-th new token with p + i keys, n * (p + (n + 1) / 2) in all (a decode row: its whole context)."""
    return float(sum(n * (p + (n + 1) / 2) for p, n in zip(prefix_lens, extend_lens)))
