"""`PoolingStep`: the pooling runner's head in the worker's step pipeline (`procs.worker.step_hooks`): its
forward pass gives every token's final hidden state, and where a token would be sampled each sampling
row gets its pooled vector (`SlotPooler`)."""

from __future__ import annotations

import numpy as np
import torch

from batchserve.kernels.attention import AttentionBackend
from batchserve.procs.worker.models.base import CausalLM, eager_hidden_states
from batchserve.procs.worker.pooling.pooler import SlotPooler
from batchserve.shared.messages import ForwardBatch, StepResult


class PoolingStep:
    def __init__(self, pooler: SlotPooler, model: CausalLM, attention: AttentionBackend) -> None:
        self.pooler = pooler
        self.model = model
        self.attention = attention

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Every token's final hidden state."""
        return eager_hidden_states(self.model, self.attention, batch)

    def result(self, batch: ForwardBatch, hidden: torch.Tensor) -> StepResult:
        """Each sampling row's pooled vector, where a token would be."""
        pooled = self.pooler.head(self.model, self.pooler.pool(hidden, batch), hidden.dtype)
        return StepResult(
            step=batch.step, next_token_ids=np.zeros(pooled.shape[0], dtype=np.int32), pooled=pooled.cpu().numpy()
        )
