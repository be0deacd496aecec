"""`DraftModel`: speculative decoding's draft model, run by the worker beside the model it serves
(`--speculative draft --draft-model PATH`).

The scheduler plans a speculative row as it plans any: its last token, then k `DRAFT_TOKEN`
placeholders, counted against the budget, the KV reservation and the step-time bound. Before the
target runs the step, the draft model fills the placeholders, one decode pass per draft position:
pass 1 runs the whole batch as the target will (prefill chunks, plain decode rows, and each
speculative row's first token), so the draft's KV always holds what the target's holds; passes 2 .. k
feed each speculative row its previous draft token. The target then verifies every row in one pass
(`procs.worker.step_sampler`, by rejection sampling against the draft distributions kept here).

The draft's KV pool mirrors the target's: the same pages, through the same page table, at the same
flat indices, so the scheduler's allocation, rollback and prefix cache serve both. A position the
draft has not written (or wrote for a token verification rejected) only lowers acceptance, never
changes the output: the target decides every token. One such gap is closed on purpose: when every
draft token of a row is accepted, the last one was never fed to the draft; the next pass 1 feeds it
first (`_Pending`).

A draft token is drawn from the draft's distribution under the request's own temperature, top-k,
top-p and min-p (argmax for greedy requests). An unseeded sampled request's tokens are verified by
rejection sampling against those distributions; a seeded request's draft draws with the noise the
model samples the same position with (`kernels.sampling.draft_sample`), and is verified by an exact
match, so its output is plain decoding's, token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from batchserve.kernels.kv_cache import KVCache
from batchserve.kernels.sampling import draft_sample
from batchserve.procs.worker.models.base import CausalLM, eager_forward
from batchserve.procs.worker.runner_setup import attention_for
from batchserve.shared.messages import DRAFT_TOKEN, ForwardBatch
from batchserve.shared.model import ModelLoadError, ModelSpec


@dataclass(frozen=True)
class DraftDistributions:
    """The draft distributions of one step's proposed tokens: `positions` index the step's sampled
    positions (`SampleRows` order) that have a proposed token after them, from an unseeded sampled
    request; `probs[i]` is the distribution that token was drawn from."""

    positions: np.ndarray  # [m] int64
    probs: torch.Tensor  # [m, vocab] float32


@dataclass(frozen=True)
class _Pending:
    """A slot's accepted last draft token that the draft model has not been fed: where it stands."""

    token: int
    position: int
    kv_loc: int


class DraftModel:
    """The draft model, its KV pool (the target's pages and page table) and its attention."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, attention_backend: str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention_for(attention_backend, model, kv_cache)
        self._pending: dict[int, _Pending] = {}
        self.proposing_s = 0.0  # the last `propose`'s time for its draft tokens (StepResult.draft_s)

    @staticmethod
    def spec_for(path: str, target: ModelSpec) -> ModelSpec:
        """The draft model's spec, checked against the target's: the same vocabulary (its tokens are
        the target's) and room for the target's whole context."""
        spec = ModelSpec.resolve(path, target.context_length)
        if spec.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"draft model {path}: its vocabulary has {spec.vocab_size} tokens, the model's "
                f"{target.vocab_size}; a draft model must share the model's tokenizer"
            )
        if spec.context_length < target.context_length:
            raise ModelLoadError(
                f"draft model {path}: its context ({spec.context_length} tokens) is shorter than "
                f"the model's ({target.context_length}); set --max-context"
            )
        return spec

    @classmethod
    def in_pool(cls, model: CausalLM, target_cache: KVCache, attention_backend: str) -> DraftModel:
        """The draft `model` (loaded from a `spec_for` spec) with a KV pool of `target_cache`'s pages that
        reads `target_cache`'s page table."""
        cfg = model.config
        cache = KVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=model.heads.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=target_cache.page_size,
            num_pages=target_cache.num_pages,
            max_running_requests=target_cache.max_running_requests,
            max_pages_per_request=target_cache.max_pages_per_request,
            dtype=target_cache.dtype,
            device=target_cache.device,
        )
        cache.page_table = target_cache.page_table  # one page table: the scheduler's pages hold both
        return cls(model, cache, attention_backend)

    def start(self, slot: int) -> None:
        """A request was admitted to `slot`: nothing of the slot's earlier request is pending."""
        self._pending.pop(slot, None)

    def propose(self, batch: ForwardBatch) -> tuple[ForwardBatch, DraftDistributions | None]:
        """Run the draft over `batch` (its page table already applied, its `FUTURE_TOKEN`s filled) and fill
        its `DRAFT_TOKEN` placeholders; the batch as the target runs it, and the distributions of its
        sampled requests' draft tokens."""
        ids = batch.input_ids
        extend = np.asarray(batch.extend_lens, dtype=np.int64)
        firsts = np.cumsum(extend) - extend
        # speculative rows: a decode row whose inputs after its first are placeholders
        drafting = [
            i for i, (e, f) in enumerate(zip(extend.tolist(), firsts.tolist())) if e > 1 and ids[f + 1] == DRAFT_TOKEN
        ]
        with torch.inference_mode():
            logits = self._first_pass(batch, drafting, firsts)
            for slot in batch.slots:  # fed now, or behind the row: `verified` says what is pending next
                self._pending.pop(slot, None)
            self.proposing_s = 0.0
            if not drafting:
                return batch, None
            assert logits is not None  # the drafting rows' logits were asked
            ids = ids.copy()  # the batch's arrays are views of the scheduler's shared memory
            widths = extend[drafting]
            sampling = [batch.sampling[i] for i in drafting]
            counts = np.asarray(batch.sample_counts, dtype=np.int64)[drafting]  # at each row's first position
            kv_locs = np.asarray(batch.kv_locs, dtype=np.int64)
            prefix = np.asarray(batch.prefix_lens, dtype=np.int64)[drafting]
            slots = np.asarray(batch.slots, dtype=np.int64)[drafting]
            row_firsts = firsts[drafting]
            started = time.perf_counter()
            passes: list[tuple[np.ndarray, torch.Tensor]] = []  # (drafting rows, their draft distributions)
            rows = np.arange(len(drafting))
            for j in range(1, int(widths.max())):
                tokens, q = draft_sample(logits, [sampling[r] for r in rows], (counts[rows] + j - 1).tolist())
                ids[row_firsts[rows] + j] = tokens.cpu().numpy()
                passes.append((rows, q))
                rows = rows[widths[rows] > j + 1]  # rows with another placeholder to fill
                if not rows.shape[0]:
                    break
                feed = row_firsts[rows] + j
                logits = self._decode_pass(slots[rows], prefix[rows] + j, ids[feed], kv_locs[feed])
            self.proposing_s = time.perf_counter() - started
        return self._filled(batch, ids), self._distributions(batch, drafting, passes)

    def verified(self, batch: ForwardBatch, accepted: np.ndarray) -> None:
        """After verification: a speculative row accepted whole leaves its last draft token pending (the draft
        was never fed it) for the slot's next row. `accepted[r]`: positions kept of the r-th row that samples
        (`SampleRows` order)."""
        extend = np.asarray(batch.extend_lens, dtype=np.int64)
        ends = np.cumsum(extend)
        sampling_rows = np.flatnonzero(np.asarray(batch.sample_lens))
        for row, kept in zip(sampling_rows.tolist(), accepted.tolist()):
            width = int(extend[row])
            if width > 1 and kept == width:
                last = int(ends[row]) - 1
                self._pending[batch.slots[row]] = _Pending(
                    int(batch.input_ids[last]), int(batch.positions[last]), int(batch.kv_locs[last])
                )

    # -- passes ------------------------------------------------------------------------------------

    def _first_pass(self, batch: ForwardBatch, drafting: list[int], firsts: np.ndarray) -> torch.Tensor | None:
        """Every row of the batch through the draft (a speculative row: its first token only, after a
        pending token where its slot has one); the logits of the speculative rows' last fed token."""
        ids, positions, kv_locs = [], [], []
        slots, prefix_lens, extend_lens, logit_rows = [], [], [], []
        speculative = set(drafting)
        fed = 0
        for i, (slot, prefix, length) in enumerate(zip(batch.slots, batch.prefix_lens, batch.extend_lens)):
            first = int(firsts[i])
            take = 1 if i in speculative else length
            pending = self._pending.get(slot)
            if pending is not None and pending.position == prefix - 1:
                ids.append(np.asarray([pending.token]))
                positions.append(np.asarray([pending.position]))
                kv_locs.append(np.asarray([pending.kv_loc]))
                prefix, take_all = prefix - 1, take + 1
            else:
                take_all = take
            ids.append(batch.input_ids[first : first + take])
            positions.append(batch.positions[first : first + take])
            kv_locs.append(batch.kv_locs[first : first + take])
            slots.append(slot)
            prefix_lens.append(prefix)
            extend_lens.append(take_all)
            fed += take_all
            if i in speculative:
                logit_rows.append(fed - 1)
        return self._run(
            slots,
            prefix_lens,
            extend_lens,
            np.concatenate(ids),
            np.concatenate(positions),
            np.concatenate(kv_locs),
            logit_rows,
        )

    def _decode_pass(
        self, slots: np.ndarray, positions: np.ndarray, ids: np.ndarray, kv_locs: np.ndarray
    ) -> torch.Tensor:
        """One token for each of `slots` (at least one) at `positions`; their logits."""
        n = slots.shape[0]
        logits = self._run(slots.tolist(), positions.tolist(), [1] * n, ids, positions, kv_locs, list(range(n)))
        assert logits is not None  # every row's were asked
        return logits

    def _run(
        self,
        slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        ids: np.ndarray,
        positions: np.ndarray,
        kv_locs: np.ndarray,
        logit_rows: list[int],
    ) -> torch.Tensor | None:
        return eager_forward(
            self.model,
            self.attention,
            slots,
            prefix_lens,
            extend_lens,
            ids,
            positions,
            kv_locs,
            np.asarray(logit_rows, dtype=np.int64),
        )

    # -- bookkeeping -------------------------------------------------------------------------------

    @staticmethod
    def _filled(batch: ForwardBatch, ids: np.ndarray) -> ForwardBatch:
        return msgspec.structs.replace(batch, input_ids=ids)

    @staticmethod
    def _distributions(
        batch: ForwardBatch, drafting: list[int], passes: list[tuple[np.ndarray, torch.Tensor]]
    ) -> DraftDistributions | None:
        """The distributions of the sampled (not greedy) speculative rows' draft tokens, by position:
        pass j proposed draft token j of the drafting rows it names."""
        lens = np.asarray(batch.sample_lens, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        # greedy, or coupled with the model's own seeded draw: verified by an exact match
        sampled = [p.temperature != 0.0 and p.seed is None for p in (batch.sampling[row] for row in drafting)]
        found = [
            (int(starts[drafting[r]]) + j, q[k])
            for j, (rows, q) in enumerate(passes)
            for k, r in enumerate(rows.tolist())
            if sampled[r]
        ]
        if not found:
            return None
        found.sort(key=lambda item: item[0])
        return DraftDistributions(
            np.asarray([at for at, _ in found], dtype=np.int64), torch.stack([q for _, q in found])
        )
