"""The attention backend interface: `plan()` once per step, then `forward()` once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from batchserve.kernels.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """One step's batch layout, as the attention backend needs it.

    Requests are in batch order; request i owns the next `extend_lens[i]` rows of the packed q/k/v
    and attends to its first `prefix_lens[i] + extend_lens[i]` cached tokens (causally for its own
    chunk), which it finds through `page_table[slots[i]]`. `kv_locs` are the flat pool indices where
    the step's new K/V go. A padded decode batch (CUDA-graph sizes) ends with `num_padding` rows of
    extend_len 1 and prefix_len 0 whose kv_loc is in the dummy page 0; backends let them attend to
    the dummy page only (their slot is ignored), so padding never reads or writes real KV.
    """

    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    kv_locs: torch.Tensor  # [num_tokens] int64 on the device
    num_padding: int = 0  # trailing padded decode rows (see above)

    @property
    def num_tokens(self) -> int:
        return int(self.kv_locs.shape[0])


class PagedRows(NamedTuple):
    """A step's rows for the fused decoder call, int64 and checked: where each row's new k/v go (kv_locs [T]),
    each decode row's pages [T, max_pages] and the tokens it attends to (lens [T]: its position + 1), and the
    prefill chunks (start, length) [C, 2] by start (None: none), whose pages lie in order from the chunk's first
    row on (through its later rows where they are longer than a row)."""

    kv_locs: torch.Tensor
    pages: torch.Tensor
    lens: torch.Tensor
    chunks: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the paged pool and attends over the cached context: every
    position before a query and itself, or in a sliding-window layer (`windows[layer]` = W > 0) the
    last W of them, as transformers masks (key position > query position - W). `softcap` > 0: scores
    (scaled) are soft-capped to softcap * tanh(score / softcap) before the softmax (Gemma 2). A layer
    with attention sinks (gpt-oss) passes `forward` its `sinks` [H] fp32: per query head a logit that
    joins the softmax's denominator and attends to nothing, so a head may attend to little. Sliding
    layers may keep their KV in rings (`kernels.kv_cache`), through their own page table and write
    locations (`in_ring`). With `causal` False (an encoder) a row's tokens attend to each other both ways.
    """

    name: str = ""
    # The widest row after a cached prefix that attends through a ring's pages (None: any row, so rings hold
    # a whole step); a longer one reads the window before it from the ring and its own k/v beside it.
    ring_row_tokens: int | None = None

    def __init__(
        self,
        kv_cache: KVCache,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        windows: Sequence[int] = (),
        softcap: float = 0.0,
        causal: bool = True,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        layers = len(kv_cache.k)
        self.windows = tuple(int(w) for w in windows) or (0,) * layers  # per layer; 0: the whole context
        if len(self.windows) != layers or min(self.windows) < 0:
            raise ValueError(f"windows {self.windows}: one per layer ({layers}), each >= 0")
        self.softcap = float(softcap)
        # False: an encoder's (BERT's) bidirectional attention, every token of a row attending to every
        # other; its rows are whole inputs (the scheduler runs them in one step each), never after a prefix
        self.causal = causal
        if kv_cache.ring_layers and set(kv_cache.ring_layers) != {i for i, w in enumerate(self.windows) if w}:
            raise ValueError(f"ring layers {kv_cache.ring_layers} must be the sliding ones (windows {self.windows})")
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare per-step index tensors (called once per step, after the page table is updated)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> attention output [T, H, D]; stores k/v at the planned kv_locs."""

    def in_ring(self, window: int) -> bool:
        """Whether the layers of `window` keep their KV in the cache's rings (`kernels.kv_cache`): their page
        table is `ring_table`, their new tokens go to `ring_locs`."""
        return bool(window) and self.kv_cache.ring_pages > 0

    def paged_rows(self) -> PagedRows | None:
        """The planned step's rows as `kernels.decode_layers` runs every layer from in one call, when this
        backend attends all of them with the C kernels; None otherwise (the default)."""
        return None


def plan_step(attention: AttentionBackend, metadata: AttentionMetadata, *, graph: bool = False) -> None:
    """Plan a step: the backend (`plan_cuda_graph` for a padded decode batch a graph replays), and a hybrid
    model's recurrent states (`kernels.recurrent_state`), which its linear layers read by the same rows."""
    if graph:
        assert isinstance(attention, CudaGraphAttentionBackend)
        attention.plan_cuda_graph(metadata)
    else:
        attention.plan(metadata)
    if attention.kv_cache.states is not None:
        attention.kv_cache.states.plan(metadata)


class CudaGraphAttentionBackend(AttentionBackend):
    """A backend whose padded decode step can be captured in a CUDA graph.

    `init_cuda_graphs(batch_sizes)` allocates fixed-size index buffers once; `plan_cuda_graph`
    (a decode batch padded to one of those sizes) rewrites them in place, so a graph captured after
    one such plan replays correctly after a later one.
    """

    @abstractmethod
    def init_cuda_graphs(self, batch_sizes: Sequence[int]) -> None:
        """Allocate the static decode buffers for these (padded) batch sizes."""

    @abstractmethod
    def plan_cuda_graph(self, metadata: AttentionMetadata) -> None:
        """Like `plan`, for a decode-only batch whose size is one of the `init_cuda_graphs` sizes."""
