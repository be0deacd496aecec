"""`SlotPooler`: the pooling runner's head. Each pooling request's prompt runs as prefill chunks, each
a row of some step; the row of its last chunk samples once, and where a generating request would get
a token it gets its pooled vector: the last token's final hidden state, the mean of all of them, or
the first's (CLS), as the model's files say (`shared.pooling`). A chunked prompt's mean and first
token live in its slot between chunks (a chunk starting at position 0 starts them afresh: a new
request, or a preempted one recomputed). The vector leaves as the model computed it, float32, neither
cut nor normalised: that is per request, and the api does it (`shared.pooling.finish_vector`). A
cross-encoder's [CLS] state goes on to its classification head, a decoder reranker's last state to its LM
head's yes and no logits (`head`), and their logit leaves instead."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchserve.shared.messages import ForwardBatch
from batchserve.shared.pooling import PoolerConfig


class SlotPooler:
    def __init__(self, config: PoolerConfig, max_running_requests: int, hidden_size: int, device: torch.device):
        self.config = config
        # the sum of a slot's hidden states so far (mean), or its first token's (cls)
        self.kept = torch.zeros(max_running_requests, hidden_size, dtype=torch.float32, device=device)

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The vectors of `batch`'s sampling rows [num_sampled, hidden] float32, in batch order, from every
        token's final hidden state `hidden` [num_tokens, hidden]; the slots' running state updated."""
        extend = torch.as_tensor(batch.extend_lens, dtype=torch.int64, device=hidden.device)
        ends = torch.cumsum(extend, 0)
        starts = ends - extend
        slots = torch.as_tensor(batch.slots, dtype=torch.int64, device=hidden.device)
        prefix = torch.as_tensor(batch.prefix_lens, dtype=torch.int64, device=hidden.device)
        sampling = torch.as_tensor(np.flatnonzero(np.asarray(batch.sample_lens) > 0), device=hidden.device)
        kind = self.config.pooling
        if kind == "last":
            return hidden[ends[sampling] - 1].float()
        first = prefix == 0  # rows that start a prompt
        if kind == "cls":
            self.kept[slots[first]] = hidden[starts[first]].float()
            return self.kept[slots[sampling]]
        self.kept[slots[first]] = 0.0
        self.kept.index_add_(0, torch.repeat_interleave(slots, extend), hidden.float())
        lengths = (prefix + extend)[sampling].unsqueeze(1).to(torch.float32)
        return self.kept[slots[sampling]] / lengths

    def head(self, model: Any, pooled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What leaves for the pooled states [rows, hidden] (float32): themselves (an embedding), a cross-
        encoder's classification logit of its [CLS] state, or a decoder reranker's LM-head logit of its true
        token less its false token's (float32 [rows, 1]); the heads run in the model's `dtype`."""
        config = self.config
        if config.kind != "classify":
            return pooled.float()
        pooled = pooled.to(dtype)
        if not config.logit_tokens:
            return model.classify(pooled).float()
        logits = model.lm_head_logits(pooled)[:, list(config.logit_tokens)]
        return (logits[:, :1] - logits[:, 1:2]) if logits.shape[1] == 2 else logits
