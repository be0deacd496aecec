"""The paged KV pool and the page table, on one device: the layout attention kernels read and write.

Per layer, K and V are `[num_pages, page_size, num_kv_heads, head_dim]`; a token's flat index is
`page * page_size + offset`. Page 0 is a dummy page: padded batch rows write there and masked-out
gathers read there, so it is never handed to a request and `kv_capacity_tokens` excludes it.
The page table `[max_running_requests, max_pages_per_request]` (int32) maps a request slot's
page-table column to its page; the scheduler decides, the worker applies the updates each step.
How many pages the worker's pool gets is the worker's choice (`procs/worker/kv_cache.py`).
"""

from __future__ import annotations

import numpy as np
import torch


class KVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                 max_running_requests: int, max_pages_per_request: int, dtype: torch.dtype, device: torch.device):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least one page besides the dummy page 0")
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = device
        self.dtype = dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # zeros, not empty: attention gathers whole pages and masks the unwritten tail of a request's
        # last page, and a masked 0 * NaN from uninitialised memory would still poison the row.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_flat = [t.view(num_pages * page_size, num_kv_heads, head_dim) for t in self.k]
        self.v_flat = [t.view(num_pages * page_size, num_kv_heads, head_dim) for t in self.v]
        self.page_table = torch.zeros((max_running_requests, max_pages_per_request), dtype=torch.int32, device=device)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the scheduler may place: every page but the dummy page 0."""
        return (self.num_pages - 1) * self.page_size

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def max_running_requests(self) -> int:
        return int(self.page_table.shape[0])

    @property
    def max_pages_per_request(self) -> int:
        return int(self.page_table.shape[1])

    def apply_page_table_updates(self, slots: np.ndarray, cols: np.ndarray, pages: np.ndarray) -> None:
        """`page_table[slots[j], cols[j]] = pages[j]`, after checking every index is in range."""
        if not (len(slots) == len(cols) == len(pages)):
            raise ValueError("page_table_slots, page_table_cols and page_table_pages differ in length")
        if len(slots) == 0:
            return
        for name, values, bound in (("slot", slots, self.max_running_requests),
                                    ("column", cols, self.max_pages_per_request),
                                    ("page", pages, self.num_pages)):
            if int(values.min()) < 0 or int(values.max()) >= bound:
                raise ValueError(f"page-table {name} out of range [0, {bound}): {values.min()}..{values.max()}")
        rows = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        columns = torch.from_numpy(np.asarray(cols, dtype=np.int64)).to(self.device)
        self.page_table[rows, columns] = torch.from_numpy(np.asarray(pages, dtype=np.int32)).to(self.device)
