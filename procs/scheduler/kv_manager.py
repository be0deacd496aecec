"""The KV pages of admitted requests: what admission reserves, preemption when an estimate proves
short, and the pages each planned step writes into.

SCHEDULING.md counts token positions (page size 1); here they are whole pages. For an admitted r,
    reservation(r) = ceil(T(r) / page_size) pages,  T(r) = max(kv_len, prompt_len) + est_future(r),
which is `allocated(r) + est(r)`: the KV it holds plus the prompt tokens still to prefill plus
est_future(r) = ceil(rho * (max_tokens - generated)). A waiting request X fits when a slot is free and
    reservation(X) + sum of reservation(r) over admitted r <= usable pages.
With rho = 1 that is the chapter's worst case: reservations only shrink and no step can run out of
pages. With rho < 1 a request can outgrow its estimate, and step 3b preempts the most recently
admitted requests until the pages the planned step needs fit in the pool.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from procs.scheduler.config import SchedulerConfig
from procs.scheduler.kv_allocator import KVAllocatorError, PageAllocator
from procs.scheduler.request import Request
from procs.scheduler.request_table import RequestTable

_EMPTY = np.zeros(0, dtype=np.int64)


class PageTableUpdates(NamedTuple):
    """New page-table entries: `page_table[slots[j], cols[j]] = pages[j]` (what the worker applies)."""

    slots: np.ndarray
    cols: np.ndarray
    pages: np.ndarray


NO_UPDATES = PageTableUpdates(_EMPTY, _EMPTY, _EMPTY)


class KVManager:
    def __init__(self, config: SchedulerConfig, table: RequestTable) -> None:
        self.page_size = config.page_size
        self.num_pages = config.num_kv_pages
        self.reserve_percent = config.kv_reserve_percent
        self.allocator = PageAllocator(self.num_pages)
        self.table = table

    def pages_for(self, tokens: int | np.ndarray) -> int | np.ndarray:
        return -(-tokens // self.page_size)

    def future_estimate(self, remaining: int | np.ndarray) -> int | np.ndarray:
        """ceil(rho * remaining) in integers, exactly as SCHEDULING.md computes it."""
        return (self.reserve_percent * remaining + 99) // 100

    # ---------------------------------------------------------------- admission
    def reservation(self, request: Request) -> int:
        """Pages a waiting request reserves on admission (its whole prompt is still to prefill)."""
        return int(self.pages_for(request.prompt_len + self.future_estimate(
            request.max_tokens - request.num_generated_before)))

    def reserved_pages(self) -> int:
        """Sum of reservation(r) over the admitted requests, from the request table's columns."""
        t = self.table
        used = t.admit_seq >= 0
        tokens = np.maximum(t.kv_len[used], t.prompt_len[used]) + self.future_estimate(
            t.token_limit[used] - t.generated[used])
        return int(self.pages_for(tokens).sum())

    # ---------------------------------------------------------------- a planned step
    def growth(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Pages each planned item adds: pages for its KV after the step, minus the pages it holds."""
        t = self.table
        return self.pages_for(t.kv_len[slots] + tokens) - t.num_pages[slots]

    def preemption_victims(self, slots: np.ndarray, growth: np.ndarray) -> list[int]:
        """SCHEDULING.md step 3b: while the pages held plus the planned growth exceed the pool, the
        most recently admitted request goes (its pages and its planned growth with it).

        Returns the victims' slots in preemption order; [] in the common case, at the cost of a sum.
        """
        excess = self.allocator.num_used + int(growth.sum()) - self.num_pages
        if excess <= 0:
            return []
        t = self.table
        planned = np.zeros(t.num_slots, dtype=np.int64)
        planned[slots] = growth
        admit_seq = t.admit_seq.copy()
        victims: list[int] = []
        while excess > 0:
            slot = int(admit_seq.argmax())
            if admit_seq[slot] < 0:  # the oldest request alone always fits: unreachable unless accounting broke
                raise KVAllocatorError(f"preempting every request leaves {excess} pages short")
            admit_seq[slot] = -1
            victims.append(slot)
            excess -= int(t.num_pages[slot] + planned[slot])
        return victims

    def allocate(self, slots: np.ndarray, growth: np.ndarray) -> PageTableUpdates:
        """Give each planned item its `growth` new pages, appended to its row of the page table."""
        t = self.table
        have = t.num_pages[slots]
        if growth.shape[0] and int(growth.max()) <= 1:  # decode steps: at most one new page per item
            grows = growth.astype(bool)
            new_slots, new_cols = slots[grows], have[grows]
            total = int(new_slots.shape[0])
        else:
            total = int(growth.sum())
            new_slots = np.repeat(slots, growth)
            new_cols = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(growth) - growth - have, growth)
        if not total:
            return NO_UPDATES
        pages = self.allocator.alloc(total)
        t.ensure_columns(int(new_cols.max()) + 1)
        t.page_table[new_slots, new_cols] = pages
        t.num_pages[slots] = have + growth
        return PageTableUpdates(new_slots, new_cols, pages)

    def release(self, slots: np.ndarray) -> None:
        """Empty the slots' table rows and give their pages back."""
        self.allocator.free(self.table.release(slots))
