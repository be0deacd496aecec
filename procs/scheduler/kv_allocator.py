"""KV page allocator: a free list of page ids 1..num_pages (page 0 is the worker's dummy page).

Admission control (the reservation check) guarantees that an allocation never fails; if one does,
the scheduler's accounting is broken and `KVAllocatorError` says so loudly.
"""

from __future__ import annotations

import numpy as np


class KVAllocatorError(RuntimeError):
    """An allocation beyond the free pages, or a double free: a scheduler accounting bug."""


class PageAllocator:
    """Stack of free page ids held in a numpy array: O(k) alloc/free of k pages, no Python loop."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Reversed so that a fresh allocator hands out pages 1, 2, 3, ... (readable traces).
        self._free = np.arange(num_pages, 0, -1, dtype=np.int32)
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def alloc(self, count: int) -> np.ndarray:
        """`count` distinct free page ids (int32), in allocation order."""
        if count > self._num_free:
            raise KVAllocatorError(f"asked for {count} KV pages with only {self._num_free} free")
        top = self._num_free
        self._num_free = top - count
        return self._free[self._num_free : top][::-1].copy()

    def free(self, pages: np.ndarray) -> None:
        count = int(pages.shape[0])
        if self._num_free + count > self.num_pages:
            raise KVAllocatorError(f"freeing {count} pages would exceed the pool of {self.num_pages}")
        self._free[self._num_free : self._num_free + count] = pages[::-1]
        self._num_free += count
