"""The request table: one row (slot) per admitted request, with its numeric state as numpy columns.

Keeping per-slot state in arrays lets a decode step read positions, last tokens and KV locations
for every running request with a handful of vectorised operations instead of a Python loop.
The page-table mirror grows its columns on demand (a request's pages are a row prefix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from procs.scheduler.request import Request

_INITIAL_COLUMNS = 64


class RequestTable:
    def __init__(self, num_slots: int, max_columns: int) -> None:
        self.num_slots = num_slots
        self.max_columns = max_columns
        self.requests: list[Request | None] = [None] * num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # stack: slot 0 is handed out first
        self.kv_len = np.zeros(num_slots, dtype=np.int64)  # positions holding KV: prefilled + fed back
        self.generated = np.zeros(num_slots, dtype=np.int64)  # tokens sampled so far
        self.token_limit = np.zeros(num_slots, dtype=np.int64)  # max_tokens
        self.last_token = np.zeros(num_slots, dtype=np.int32)  # next decode input
        self.check_eos = np.zeros(num_slots, dtype=bool)  # not ignore_eos
        self.has_stop_ids = np.zeros(num_slots, dtype=bool)
        self.num_pages = np.zeros(num_slots, dtype=np.int64)  # pages held (row prefix of page_table)
        self.reserved_pages = np.zeros(num_slots, dtype=np.int64)  # held + may still need
        self.page_table = np.zeros((num_slots, min(_INITIAL_COLUMNS, max_columns)), dtype=np.int32)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def acquire(self, request: Request, reserved_pages: int) -> int:
        slot = self._free_slots.pop()
        self.requests[slot] = request
        self.kv_len[slot] = 0
        self.generated[slot] = 0
        self.token_limit[slot] = request.max_tokens
        self.last_token[slot] = 0
        self.check_eos[slot] = not request.stop.ignore_eos
        self.has_stop_ids[slot] = bool(request.stop_ids)
        self.num_pages[slot] = 0
        self.reserved_pages[slot] = reserved_pages
        return slot

    def release(self, slots: np.ndarray) -> np.ndarray:
        """Empty the rows; returns the pages they held (for the allocator)."""
        counts = self.num_pages[slots]
        width = int(counts.max()) if slots.shape[0] else 0
        pages = self.page_table[slots, :width][np.arange(width) < counts[:, None]]
        self.num_pages[slots] = 0
        self.reserved_pages[slots] = 0
        for slot in slots.tolist():
            self.requests[slot] = None
            self._free_slots.append(slot)
        return pages

    def ensure_columns(self, count: int) -> None:
        cols = self.page_table.shape[1]
        if count <= cols:
            return
        if count > self.max_columns:
            raise ValueError(f"a request needs {count} page-table columns, more than the {self.max_columns} allowed")
        grown = np.zeros((self.num_slots, min(self.max_columns, max(count, 2 * cols))), dtype=np.int32)
        grown[:, :cols] = self.page_table
        self.page_table = grown
