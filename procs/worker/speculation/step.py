"""`DraftStep`: the draft model's hooks in the worker's step pipeline (`procs.worker.step_hooks`).

It runs every step, so that its KV holds what the model's holds: a new slot has nothing pending
(`start`); before the forward pass it applies the step's page-table updates (the draft reads the same
table) and fills the rows' draft placeholders (`rewrite`); after sampling it is told what verification
accepted (`verified`), and the step's result carries its time (`annotate`)."""

from __future__ import annotations

import msgspec
import numpy as np

from batchserve.kernels.kv_cache import KVCache
from batchserve.procs.worker.speculation.draft_model import DraftDistributions, DraftModel
from batchserve.shared.messages import ForwardBatch, StepResult


class DraftStep:
    def __init__(self, draft: DraftModel, kv_cache: KVCache) -> None:
        self.draft = draft
        self.kv_cache = kv_cache
        self._distributions: DraftDistributions | None = None

    def start(self, batch: ForwardBatch) -> float:
        for start in batch.slot_starts:
            self.draft.start(start.slot)
        return 0.0

    def rewrite(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with its drafts filled in, without its page-table updates (applied now, so that the
        forward pass does not apply them again; no other rank needs them: a draft model runs with one rank
        only, `check_config`)."""
        self.kv_cache.apply_page_table_updates(batch.page_table_slots, batch.page_table_cols, batch.page_table_pages)
        none = np.zeros(0, dtype=np.int32)
        batch = msgspec.structs.replace(batch, page_table_slots=none, page_table_cols=none, page_table_pages=none)
        batch, self._distributions = self.draft.propose(batch)
        return batch

    @property
    def distributions(self) -> DraftDistributions | None:
        """The distributions of the last step's drawn drafts (rejection sampling, `StepSampler`)."""
        return self._distributions

    def verified(self, batch: ForwardBatch, accepted: np.ndarray) -> None:
        self.draft.verified(batch, accepted)

    def annotate(self, result: StepResult) -> None:
        result.draft_s = self.draft.proposing_s
