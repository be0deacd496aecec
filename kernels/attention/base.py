"""The attention backend interface: `plan()` once per step, then `forward()` once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from procs.worker.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """One step's batch layout, as the attention backend needs it.

    Requests are in batch order; request i owns the next `extend_lens[i]` rows of the packed q/k/v
    and attends to its first `prefix_lens[i] + extend_lens[i]` cached tokens (causally for its own
    chunk), which it finds through `page_table[slots[i]]`. `kv_locs` are the flat pool indices where
    the step's new K/V go. A padded decode batch (CUDA-graph sizes) appends rows with extend_len 1,
    prefix_len 0, a slot whose page-table row points at page 0 and kv_loc 0, so padding only ever
    touches the dummy page.
    """

    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    kv_locs: torch.Tensor  # [num_tokens] int64 on the device

    @property
    def num_tokens(self) -> int:
        return int(self.kv_locs.shape[0])


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the paged pool and attends over the cached context."""

    name: str = ""

    def __init__(self, kv_cache: "KVCache", num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare per-step index tensors (called once per step, after the page table is updated)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> attention output [T, H, D]; stores k/v at the planned kv_locs."""
