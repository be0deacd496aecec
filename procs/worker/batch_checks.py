"""`check_batch`: a `ForwardBatch` checked before it runs (with BATCHSERVE_DEBUG_CHECKS=1 only). The
scheduler plans batches that pass by construction; the check is for debugging a scheduler change."""

from __future__ import annotations

import numpy as np

from batchserve.shared.messages import DRAFT_TOKEN, FUTURE_TOKEN, ForwardBatch


def check_batch(
    batch: ForwardBatch, max_running_requests: int, max_context: int, pool_tokens: int, vocab_size: int, has_draft: bool
) -> None:
    """Reject a malformed batch with a ValueError before it can corrupt the KV pool."""
    n = batch.num_requests
    if not (
        len(batch.prefix_lens)
        == len(batch.extend_lens)
        == len(batch.sample_lens)
        == len(batch.sampling)
        == len(batch.sample_counts)
        == n
    ):
        raise ValueError("ForwardBatch per-request lists differ in length")
    tokens = batch.num_tokens
    if sum(batch.extend_lens) != tokens or batch.positions.shape[0] != tokens or batch.kv_locs.shape[0] != tokens:
        raise ValueError(
            f"ForwardBatch: sum(extend_lens)={sum(batch.extend_lens)}, input_ids={tokens}, "
            f"positions={batch.positions.shape[0]}, kv_locs={batch.kv_locs.shape[0]} disagree"
        )
    if n == 0:
        raise ValueError("ForwardBatch has no requests")
    if min(batch.extend_lens) < 1 or min(batch.prefix_lens) < 0:
        raise ValueError("ForwardBatch: extend_lens must be >= 1 and prefix_lens >= 0")
    lens = zip(batch.prefix_lens, batch.extend_lens, batch.sample_lens)
    if any(not 0 <= s <= e or (s > 1 and (p == 0 or s != e)) for p, e, s in lens):
        raise ValueError(
            "ForwardBatch: sample_lens must be in [0, extend_len], and above 1 only for a decode "
            "row (prefix_len > 0, sample_len == extend_len)"
        )
    if any(not 0 <= s < max_running_requests for s in [*batch.slots, *(x.slot for x in batch.slot_starts)]):
        raise ValueError(f"ForwardBatch: slot out of range [0, {max_running_requests})")
    if max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)) > max_context:
        raise ValueError(f"ForwardBatch: a request exceeds max_context {max_context}")
    if int(batch.kv_locs.min()) < 0 or int(batch.kv_locs.max()) >= pool_tokens:
        raise ValueError(f"ForwardBatch: kv_locs out of range [0, {pool_tokens})")
    if int(batch.positions.min()) < 0 or int(batch.positions.max()) >= max_context:
        raise ValueError(f"ForwardBatch: position out of range [0, {max_context})")
    if int(batch.input_ids.min()) < min(FUTURE_TOKEN, DRAFT_TOKEN) or int(batch.input_ids.max()) >= vocab_size:
        raise ValueError(f"ForwardBatch: token id out of range [0, {vocab_size})")
    firsts = np.cumsum(batch.extend_lens) - np.asarray(batch.extend_lens)
    if not np.isin(np.flatnonzero(batch.input_ids == FUTURE_TOKEN), firsts).all():
        raise ValueError("ForwardBatch: FUTURE_TOKEN stands other than first in a row")
    if (batch.input_ids == DRAFT_TOKEN).any() and (
        not has_draft or np.isin(np.flatnonzero(batch.input_ids == DRAFT_TOKEN), firsts).any()
    ):
        raise ValueError("ForwardBatch: DRAFT_TOKEN without a draft model, or first in a row")
