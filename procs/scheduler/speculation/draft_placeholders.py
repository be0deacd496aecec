"""The scheduler's side of a draft model (`--speculative draft`): rows of placeholders.

The draft model runs in the worker, on the step itself (`procs/worker/speculation/draft_model.py`), so the
scheduler proposes no tokens: it gives a speculative row `DRAFT_TOKEN`s, as many as the row may carry,
and plans, reserves and bounds the row by that width like any draft (SCHEDULING.md 6.4). The worker
fills them before the model runs; verification and rollback are the same as for prompt lookup.
"""

from __future__ import annotations

import numpy as np

from batchserve.shared.messages import DRAFT_TOKEN


class DraftPlaceholders:
    """A `Proposer`: `num_tokens` placeholders (fewer where the row has less room), whatever the history."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose(self, history: np.ndarray, limit: int, rid: str = "") -> np.ndarray:
        return np.full(max(0, min(self.num_tokens, limit)), DRAFT_TOKEN, dtype=np.int32)
