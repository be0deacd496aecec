"""The size of the worker's KV pool (`kernels/kv_cache.py`'s `KVCache`): pages for a token capacity
or a memory budget, and the budget itself (given, a share of the device's free memory, or the CPU's
default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

GIB = 1024**3
CPU_KV_MEMORY_GB = 1.0  # the CPU pool when no size is given (host memory is shared with everything else)


def kv_memory_budget_gb(
    device: torch.device,
    memory_gb: float,
    memory_fraction: float,
    mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None,
) -> float:
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


def num_pages_for(page_size: int, *, capacity_tokens: int = 0, memory_gb: float = 0.0, bytes_per_token: int = 1) -> int:
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


def ring_layers(windows: Sequence[int], step_tokens: int) -> tuple[int, ...]:
    """The layers that keep their KV in rings (`kernels.kv_cache`): the sliding ones of a model that mixes
    sliding and global layers (or windows of several widths), when a request's steps take at most
    `step_tokens` tokens after its first (0: no rings, every layer keeps the whole context). A model whose
    every layer slides by one window gives back its pages behind the window in the scheduler instead."""
    if not step_tokens or len(set(windows)) <= 1:
        return ()
    return tuple(layer for layer, window in enumerate(windows) if window)


def ring_pages_for(window: int, step_tokens: int, page_size: int) -> int:
    """Pages of one slot's ring: the columns a window of `window` before a step of `step_tokens` tokens and
    the step itself span, at most."""
    return (window + step_tokens - 2) // page_size + 2
