"""The request table: one row (slot) per admitted request, with its numeric state as numpy columns.

The columns are the vectorised copy of the admitted requests' numbers: what a `Request` holds once
(its prompt, token limit, stop conditions) is copied into its row at admission, and the token-level
counts that change every step (KV positions, tokens sampled, the last token, pages) live only here,
so that a decode step reads and advances every running request with a handful of vectorised
operations instead of a Python loop. The page-table mirror grows its columns on demand (a request's
pages are a row prefix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from batchserve.procs.scheduler.request import Request

_INITIAL_COLUMNS = 64


class RequestTable:
    def __init__(self, num_slots: int, max_columns: int) -> None:
        self.num_slots = num_slots
        self.max_columns = max_columns
        self.requests: list[Request | None] = [None] * num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # stack: slot 0 is handed out first
        self.admit_seq = np.full(num_slots, -1, dtype=np.int64)  # admission sequence number; -1: free
        self.prompt_len = np.zeros(num_slots, dtype=np.int64)  # tokens to prefill (recompute included)
        self.kv_len = np.zeros(num_slots, dtype=np.int64)  # positions holding KV: prefilled + fed back
        self.generated = np.zeros(
            num_slots, dtype=np.int64
        )  # tokens sampled, launched steps in flight and preemptions included
        self.reported = np.zeros(num_slots, dtype=np.int64)  # tokens appended by completed steps (Request.reported)
        self.token_limit = np.zeros(num_slots, dtype=np.int64)  # Request.max_tokens
        self.last_token = np.zeros(num_slots, dtype=np.int32)  # next decode input
        self.check_eos = np.zeros(num_slots, dtype=bool)  # not ignore_eos
        self.has_stop_ids = np.zeros(num_slots, dtype=bool)  # stop_token_ids given: check its tokens against them
        self.num_pages = np.zeros(num_slots, dtype=np.int64)  # pages held (row prefix of page_table)
        self.shared_pages = np.zeros(num_slots, dtype=np.int64)  # of those, prefix-cache pages (not its own)
        # of those, the leading columns whose pages went back out of a sliding window (page 0 there now)
        self.dropped_pages = np.zeros(num_slots, dtype=np.int64)
        self.page_table = np.zeros((num_slots, min(_INITIAL_COLUMNS, max_columns)), dtype=np.int32)
        # Generated ids, kept so that a preempted request can be recomputed from them.
        self.output_ids = np.zeros((num_slots, _INITIAL_COLUMNS), dtype=np.int32)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def acquire(self, request: Request, admit_seq: int) -> int:
        slot = self._free_slots.pop()
        self.requests[slot] = request
        generated_before = request.num_generated_before
        self.admit_seq[slot] = admit_seq
        self.prompt_len[slot] = request.prompt_len
        self.kv_len[slot] = 0
        self.generated[slot] = generated_before
        self.reported[slot] = request.reported
        self.token_limit[slot] = request.max_tokens
        self.last_token[slot] = 0
        stop = request.params.stop
        self.check_eos[slot] = not stop.ignore_eos
        self.has_stop_ids[slot] = bool(stop.stop_token_ids)
        self.num_pages[slot] = 0
        self.shared_pages[slot] = 0
        self.dropped_pages[slot] = 0
        if request.max_tokens > self.output_ids.shape[1]:
            self.output_ids = _widen(self.output_ids, max(request.max_tokens, 2 * self.output_ids.shape[1]))
        self.output_ids[slot, :generated_before] = request.prompt[request.num_prompt_tokens :]
        return slot

    def release(self, slots: np.ndarray) -> np.ndarray:
        """Empty the rows (their requests keep their reported count); returns the pages they held (for the
        allocator; not the dropped ones, given back already)."""
        counts = self.num_pages[slots]
        width = int(counts.max()) if slots.shape[0] else 0
        columns = np.arange(width)
        pages = self.page_table[slots, :width][
            (columns < counts[:, None]) & (columns >= self.dropped_pages[slots, None])
        ]
        self.num_pages[slots] = 0
        self.shared_pages[slots] = 0
        self.dropped_pages[slots] = 0
        self.admit_seq[slots] = -1
        for slot in slots.tolist():
            self.requests[slot].reported = int(self.reported[slot])
            self.requests[slot] = None
            self._free_slots.append(slot)
        return pages

    def ensure_columns(self, count: int) -> None:
        if count <= self.page_table.shape[1]:
            return
        if count > self.max_columns:
            raise ValueError(f"a request needs {count} page-table columns, more than the {self.max_columns} allowed")
        self.page_table = _widen(self.page_table, min(self.max_columns, max(count, 2 * self.page_table.shape[1])))


def _widen(table: np.ndarray, columns: int) -> np.ndarray:
    grown = np.zeros((table.shape[0], columns), dtype=table.dtype)
    grown[:, : table.shape[1]] = table
    return grown
