"""The paged KV pool and the page table, both on the worker's device.

Per layer, K and V are `[num_pages, page_size, num_kv_heads, head_dim]`; a token's flat index is
`page * page_size + offset`. Page 0 is a dummy page: padded batch rows write there and masked-out
gathers read there, so it is never handed to a request and `kv_capacity_tokens` excludes it.
The page table `[max_running_requests, max_pages_per_request]` (int32) maps a request slot's
page-table column to its page; the scheduler decides, the worker applies the updates each step.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

GIB = 1024 ** 3
CPU_KV_MEMORY_GB = 1.0  # the CPU pool when no size is given (host memory is shared with everything else)


def kv_memory_budget_gb(device: torch.device, memory_gb: float, memory_fraction: float,
                        mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None) -> float:
    """GiB for the KV pool: `memory_gb` when given (> 0); on CUDA, else, `memory_fraction` of the device
    memory free now (call it after the weights are loaded: the rest is headroom for activations,
    CUDA graphs and the allocator, as SGLang's --mem-fraction-static / vLLM's
    --gpu-memory-utilization leave); on the CPU, else, `CPU_KV_MEMORY_GB`."""
    if not 0 < memory_fraction < 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1), got {memory_fraction}")
    if memory_gb < 0:
        raise ValueError(f"kv_memory_gb must be >= 0 (0: automatic), got {memory_gb}")
    if memory_gb > 0:
        return memory_gb
    if device.type != "cuda":
        return CPU_KV_MEMORY_GB
    free, _total = (mem_get_info or torch.cuda.mem_get_info)(device)
    return memory_fraction * free / GIB


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element


def num_pages_for(page_size: int, *, capacity_tokens: int = 0, memory_gb: float = 0.0,
                  bytes_per_token: int = 1) -> int:
    """Pages (dummy page included) for a token capacity, or else for a memory budget in GiB."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if capacity_tokens > 0:
        usable = math.ceil(capacity_tokens / page_size)
    elif memory_gb > 0:
        usable = int(memory_gb * GIB) // (bytes_per_token * page_size) - 1
    else:
        raise ValueError("give the KV cache a capacity: kv_capacity_tokens > 0 or kv_memory_gb > 0")
    if usable < 1:
        raise ValueError(f"KV budget too small: {memory_gb} GiB holds no page of {page_size} tokens")
    return usable + 1


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
