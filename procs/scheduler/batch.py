"""A planned step (`StepPlan`) and its packing into the `ForwardBatch` the worker executes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from batchserve.procs.scheduler.kv_manager import PageTableUpdates
from batchserve.procs.scheduler.request import Request
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.shared.messages import ForwardBatch, SamplingParams, SlotStart
from batchserve.shared.ranges import concat_ranges

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)


class DecodeView(NamedTuple):
    """The decode rows a step may run, in admission order: slots, ids, sampling params, and each row's
    width (the tokens it feeds and samples: its last token, then its draft), `tokens` their sum."""

    slots: np.ndarray
    rids: list[str]
    sampling: list[SamplingParams]
    widths: np.ndarray
    tokens: int


NO_DECODES = DecodeView(_EMPTY_I64, [], [], _EMPTY_I64, 0)


class StepPlan(NamedTuple):
    """What one step runs: decodes (slots, ids, sampling, widths, in admission order), then prefill chunks."""

    prefill: list[tuple[Request, int]]  # (request, prompt tokens this step)
    prefill_slots: np.ndarray
    decode_slots: np.ndarray
    decode_rids: list[str]
    decode_sampling: list[SamplingParams]
    decode_widths: np.ndarray  # tokens each decode row feeds (1 + its draft)
    decode_tokens: int  # their sum

    @classmethod
    def of(cls, prefill: list[tuple[Request, int]], decode: DecodeView = NO_DECODES) -> StepPlan:
        slots = np.fromiter((r.slot for r, _ in prefill), dtype=np.int64, count=len(prefill))
        return cls(prefill, slots, *decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode_slots.shape[0]

    def slots_and_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """Every item's slot and the KV positions it adds this step (decodes first)."""
        if not self.prefill:
            return self.decode_slots, self.decode_widths
        tokens = np.fromiter((n for _, n in self.prefill), dtype=np.int64, count=len(self.prefill))
        if not self.decode_slots.shape[0]:
            return self.prefill_slots, tokens
        return (np.concatenate([self.decode_slots, self.prefill_slots]), np.concatenate([self.decode_widths, tokens]))

    def without_drafts(self) -> StepPlan:
        """The plan with every decode row one token wide."""
        n = self.decode_slots.shape[0]
        return self._replace(decode_widths=np.ones(n, dtype=np.int64), decode_tokens=n)

    def without(self, slots: list[int]) -> StepPlan:
        """The plan minus the items of `slots` (preempted requests)."""
        gone = set(slots)
        keep = [i for i, s in enumerate(self.decode_slots.tolist()) if s not in gone]
        widths = self.decode_widths[keep]
        return StepPlan.of(
            [(r, n) for r, n in self.prefill if r.slot not in gone],
            DecodeView(
                self.decode_slots[keep],
                [self.decode_rids[i] for i in keep],
                [self.decode_sampling[i] for i in keep],
                widths,
                int(widths.sum()),
            ),
        )


class _Rows(NamedTuple):
    """Some of a step's rows, packed: their tokens' ids, positions and KV locations, and per row what
    `ForwardBatch` lists."""

    ids: np.ndarray
    pos: np.ndarray
    locs: np.ndarray
    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample_lens: list[int]
    sampling: list[SamplingParams]
    sample_counts: list[int]

    def then(self, other: _Rows) -> _Rows:
        """These rows, then `other`'s."""
        return _Rows(
            np.concatenate([self.ids, other.ids]),
            np.concatenate([self.pos, other.pos]),
            np.concatenate([self.locs, other.locs]),
            self.slots + other.slots,
            self.prefix_lens + other.prefix_lens,
            self.extend_lens + other.extend_lens,
            self.sample_lens + other.sample_lens,
            self.sampling + other.sampling,
            self.sample_counts + other.sample_counts,
        )


def build_forward_batch(
    step: int,
    plan: StepPlan,
    updates: PageTableUpdates,
    table: RequestTable,
    page_size: int,
    eos_token_ids: tuple[int, ...],
) -> ForwardBatch:
    """Pack decodes first, then prefill chunks, into the worker's arrays (pages already allocated).
    A decode row feeds its last token, then its draft (`FUTURE_TOKEN` stands only first)."""
    rows = _decode_rows(plan, table, page_size) if plan.decode_slots.shape[0] else None
    slot_starts: list[SlotStart] = []
    if plan.prefill:
        prefill = _prefill_rows(plan, table, page_size)
        rows = prefill if rows is None else rows.then(prefill)
        for request, _ in plan.prefill:
            if request.starting:
                slot_starts.append(request.slot_start(eos_token_ids))
                request.starting = False
    assert rows is not None, "an empty plan is not packed"
    return ForwardBatch(
        step=step,
        slots=rows.slots,
        prefix_lens=rows.prefix_lens,
        extend_lens=rows.extend_lens,
        sample_lens=rows.sample_lens,
        sampling=rows.sampling,
        sample_counts=rows.sample_counts,
        input_ids=_int32(rows.ids),
        positions=_int32(rows.pos),
        kv_locs=_int32(rows.locs),
        page_table_slots=_int32(updates.slots),
        page_table_cols=_int32(updates.cols),
        page_table_pages=_int32(updates.pages),
        slot_starts=slot_starts,
    )


def _decode_rows(plan: StepPlan, table: RequestTable, page_size: int) -> _Rows:
    ds = plan.decode_slots
    kv_len = table.kv_len[ds]
    ids, pos, rows = _decode_tokens(plan, table, kv_len)
    locs = table.page_table[rows, pos // page_size].astype(np.int64) * page_size + pos % page_size
    widths = plan.decode_widths.tolist()
    return _Rows(
        ids,
        pos,
        locs,
        ds.tolist(),
        kv_len.tolist(),
        widths,
        widths,
        list(plan.decode_sampling),
        table.generated[ds].tolist(),
    )


def _prefill_rows(plan: StepPlan, table: RequestTable, page_size: int) -> _Rows:
    """All chunks at once: a fixed number of numpy calls however many requests prefill."""
    reqs = [r for r, _ in plan.prefill]
    lens = [n for _, n in plan.prefill]
    starts = [r.prefilled for r in reqs]
    pslots = plan.prefill_slots
    n_arr = np.asarray(lens, dtype=np.int64)
    pos = concat_ranges(np.asarray(starts), n_arr)
    ids = np.concatenate([r.prompt[a : a + n] for r, a, n in zip(reqs, starts, lens)])
    locs = table.page_table[np.repeat(pslots, n_arr), pos // page_size].astype(np.int64) * page_size + pos % page_size
    return _Rows(
        ids,
        pos,
        locs,
        pslots.tolist(),
        starts,
        lens,
        [int(a + n == r.prompt_len) for r, a, n in zip(reqs, starts, lens)],
        [r.params.sampling for r in reqs],
        table.generated[pslots].tolist(),
    )  # > 0 when recomputing after a preemption


def _decode_tokens(
    plan: StepPlan, table: RequestTable, kv_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode rows' input ids, positions and slots, token by token: a row feeds its last token at
    its next position, then its draft one position further each."""
    ds = plan.decode_slots
    ids = table.last_token[ds]
    if plan.decode_tokens == ds.shape[0]:  # a token per row
        return ids, kv_len, ds
    widths = plan.decode_widths
    row_starts = np.cumsum(widths) - widths
    pos = np.arange(plan.decode_tokens, dtype=np.int64) - np.repeat(row_starts - kv_len, widths)
    ids = np.repeat(ids, widths)
    for i in np.flatnonzero(widths > 1).tolist():
        ids[row_starts[i] + 1 : row_starts[i] + widths[i]] = table.requests[ds[i]].draft
    return ids, pos, np.repeat(ds, widths)


def _int32(array: np.ndarray) -> np.ndarray:
    return array.astype(np.int32, copy=False)
