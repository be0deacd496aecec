"""Attention on flashinfer's paged-KV kernels (CUDA, float16/bfloat16).

The pool's per-layer K/V `[num_pages, page_size, kv_heads, head_dim]` is flashinfer's NHD layout, so
the kernels read it in place. Per step, `plan()` turns the batch into flashinfer's page lists
(`indptr` / `indices` / `last_page_len`, gathered from the page table on the device) and plans one
wrapper, once for all layers:
- decode-only steps (every request feeds one token): `BatchDecodeWithPagedKVCacheWrapper`;
- steps with prefill chunks (alone or beside decodes): `BatchPrefillWithPagedKVCacheWrapper` with
  `qo_indptr` and a causal mask (flashinfer aligns a request's queries with the end of its KV, which
  is exactly a chunk after its cached prefix).
Every layer writes its new K/V at `kv_locs` with a plain `index_copy_` into the pool, then runs the
planned wrapper. A model with sliding-window layers has one wrapper per distinct window (0: none),
planned with `window_left` = W - 1 (flashinfer's query at i sees keys i - window_left .. i), and each
layer runs its window's. Sliding layers that keep their KV in rings (`kernels.kv_cache`) read page lists
made from the ring table and write at the ring locations (in CUDA graphs: their own static buffers). A
layer with attention sinks (gpt-oss) runs with `return_lse` and rescales the
output by the keys' share beside the sink (`with_sinks`): flashinfer's own `sinks` argument is taken by
its trtllm-gen kernels only.

CUDA graphs: `init_cuda_graphs` builds one decode wrapper per captured batch size with
`use_cuda_graph=True` over shared fixed-size indptr / indices / last_page_len buffers, and
`plan_cuda_graph` rewrites those buffers (and the wrapper's plan) in place before each replay.
Padded rows get one page, the dummy page 0, holding one token.

flashinfer is imported lazily: this module imports on any machine, and asking for the backend
where flashinfer (or CUDA) is missing is a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchserve.kernels.attention.base import AttentionMetadata, CudaGraphAttentionBackend
from batchserve.shared.ranges import concat_ranges

if TYPE_CHECKING:
    from batchserve.kernels.kv_cache import KVCache

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's float workspace (split-KV partial results), shared by all wrappers
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
LN2 = math.log(2.0)


class FlashInferUnavailable(ImportError, ValueError):
    """flashinfer cannot be imported. An ImportError (so `auto` falls back to torch) and a ValueError
    (so an explicit `--attention-backend flashinfer` is reported as a user error)."""


def import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except (ImportError, OSError, RuntimeError) as exc:  # missing, or its CUDA libraries don't load
        raise FlashInferUnavailable(
            "attention backend 'flashinfer' needs the flashinfer package (pip install flashinfer-python) "
            f"and a CUDA GPU: {exc}; use --attention-backend torch"
        ) from exc
    return flashinfer


def use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """flashinfer's tensor-core decode pays off once a KV head serves 4 or more query heads."""
    return num_heads // num_kv_heads >= 4


@dataclass
class PageLists:
    """flashinfer's CSR description of each request's KV pages."""

    indptr: torch.Tensor  # [batch + 1] int32, host: request i's pages are indices[indptr[i]:indptr[i+1]]
    indices: torch.Tensor  # [indptr[-1]] int32, device
    last_page_len: torch.Tensor  # [batch] int32, host: tokens in each request's last page (1..page_size)


def page_lists(metadata: AttentionMetadata, page_table: torch.Tensor, page_size: int) -> PageLists:
    """Page lists for a step whose new K/V are already in the pool: request i's KV is its first
    `prefix_lens[i] + extend_lens[i]` tokens; padded rows hold one token in the dummy page 0."""
    n = len(metadata.slots)
    real = n - metadata.num_padding
    kv_lens = np.asarray(metadata.prefix_lens, dtype=np.int64) + np.asarray(metadata.extend_lens, dtype=np.int64)
    kv_lens[real:] = 1
    num_pages = (kv_lens + page_size - 1) // page_size
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_pages, out=indptr[1:])
    last_page_len = kv_lens - (num_pages - 1) * page_size
    real_pages = int(indptr[real])
    indices = torch.zeros(int(indptr[-1]), dtype=torch.int32, device=page_table.device)  # padding: page 0
    if real_pages:
        # flat page-table positions (slot, column) of every real request's pages, gathered on the device
        width = page_table.shape[1]
        counts = num_pages[:real]
        columns = concat_ranges(0, counts)
        flat = np.repeat(np.asarray(metadata.slots[:real], dtype=np.int64) * width, counts) + columns
        flat_t = torch.from_numpy(flat).to(page_table.device, non_blocking=True)
        indices[:real_pages] = page_table.view(-1).index_select(0, flat_t)
    return PageLists(
        indptr=torch.from_numpy(indptr.astype(np.int32)),
        indices=indices,
        last_page_len=torch.from_numpy(last_page_len.astype(np.int32)),
    )


class FlashInferAttentionBackend(CudaGraphAttentionBackend):
    name = "flashinfer"

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
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale, windows, softcap, causal)
        if kv_cache.device.type != "cuda":
            raise ValueError(
                f"attention backend 'flashinfer' runs on CUDA only (device is {kv_cache.device}); "
                "use --attention-backend torch"
            )
        if kv_cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"attention backend 'flashinfer' needs --dtype bfloat16 or float16, got {kv_cache.dtype}; "
                "use --attention-backend torch for float32"
            )
        self._flashinfer = import_flashinfer()
        device = kv_cache.device
        # zeros: flashinfer 0.7.4's decode wrapper documents its workspace "must be initialized to 0 for its first use"
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._tensor_cores = use_tensor_cores(num_heads, num_kv_heads)
        distinct = sorted(set(self.windows))
        self._prefill_wrappers = {
            w: self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD") for w in distinct
        }
        self._decode_wrappers = {
            w: self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self._tensor_cores
            )
            for w in distinct
        }
        self._graph_wrappers: dict[int, dict[int, Any]] = {}  # batch size -> window -> wrapper
        self._graph_ring_locs: torch.Tensor | None = None  # a graph's ring write locations (static)
        self._wrappers: dict[int, Any] = {}  # window -> the wrapper planned for this step
        self._kv_locs: dict[bool, torch.Tensor] = {}  # in a ring or not -> where the step's new K/V go

    # -- per step ---------------------------------------------------------------------------------

    def _shape_args(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim, self.kv_cache.page_size

    def _step_pages(self, metadata: AttentionMetadata, ring_locs: torch.Tensor | None = None) -> dict[bool, PageLists]:
        """The page lists of the step by each table its layers read (the scheduler's, the rings'), and
        where their new K/V go (the ring locations into `ring_locs` where given: a graph's static buffer)."""
        pages, self._kv_locs = {}, {}
        for ring in {self.in_ring(window) for window in self.windows}:
            table = self.kv_cache.ring_table if ring else self.kv_cache.page_table
            assert table is not None  # layers in rings: the cache has them, and their table
            pages[ring] = page_lists(metadata, table, self.kv_cache.page_size)
            locs = metadata.kv_locs
            if ring:
                self.kv_cache.check_ring_rows(metadata.prefix_lens, metadata.extend_lens)
                host = self.kv_cache.ring_locs(
                    metadata.slots, metadata.prefix_lens, metadata.extend_lens, metadata.num_padding
                )
                locs = torch.from_numpy(host).to(self.kv_cache.page_table.device, non_blocking=True)
                locs = locs if ring_locs is None else ring_locs[: locs.shape[0]].copy_(locs)
            self._kv_locs[ring] = locs
        return pages

    def _plan_decode(
        self, wrappers: dict[int, Any], metadata: AttentionMetadata, ring_locs: torch.Tensor | None = None
    ) -> None:
        step_pages = self._step_pages(metadata, ring_locs)
        for window, wrapper in wrappers.items():
            pages = step_pages[self.in_ring(window)]
            wrapper.plan(
                pages.indptr,
                pages.indices,
                pages.last_page_len,
                *self._shape_args(),
                pos_encoding_mode="NONE",
                window_left=window - 1 if window else -1,
                logits_soft_cap=self.softcap or None,
                sm_scale=self.scale,
                q_data_type=self.kv_cache.dtype,
                kv_data_type=self.kv_cache.dtype,
            )
        self._wrappers = wrappers

    def plan(self, metadata: AttentionMetadata) -> None:
        if all(length == 1 for length in metadata.extend_lens):
            self._plan_decode(self._decode_wrappers, metadata)
            return
        step_pages = self._step_pages(metadata)
        qo_indptr = torch.zeros(len(metadata.extend_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(metadata.extend_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        for window, wrapper in self._prefill_wrappers.items():
            pages = step_pages[self.in_ring(window)]
            wrapper.plan(
                qo_indptr,
                pages.indptr,
                pages.indices,
                pages.last_page_len,
                *self._shape_args(),
                causal=self.causal,
                pos_encoding_mode="NONE",
                window_left=window - 1 if window else -1,
                logits_soft_cap=self.softcap or None,
                sm_scale=self.scale,
                q_data_type=self.kv_cache.dtype,
                kv_data_type=self.kv_cache.dtype,
            )
        self._wrappers = self._prefill_wrappers

    # -- CUDA graphs --------------------------------------------------------------------------------

    def init_cuda_graphs(self, batch_sizes: Sequence[int]) -> None:
        max_bs = max(batch_sizes)
        device = self.kv_cache.device
        # Shared by every size's wrapper of one table (the scheduler's, the rings'): one graph runs at a
        # time and its plan rewrites them first.
        buffers = {
            ring: (
                torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
                torch.zeros(max_bs * self.kv_cache.max_pages_per_request, dtype=torch.int32, device=device),
                torch.ones(max_bs, dtype=torch.int32, device=device),
            )
            for ring in {self.in_ring(window) for window in self.windows}
        }
        if True in buffers:
            self._graph_ring_locs = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self._graph_wrappers = {
            size: {
                window: self._graph_wrapper(size, *buffers[self.in_ring(window)])
                for window in sorted(set(self.windows))
            }
            for size in batch_sizes
        }

    def _graph_wrapper(
        self, size: int, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> Any:
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self._tensor_cores,
            paged_kv_indptr_buffer=indptr[: size + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:size],
        )

    def plan_cuda_graph(self, metadata: AttentionMetadata) -> None:
        size = len(metadata.slots)
        wrappers = self._graph_wrappers.get(size)
        if wrappers is None:
            raise ValueError(
                f"no CUDA-graph decode buffers for batch size {size} (initialised: {sorted(self._graph_wrappers)})"
            )
        if any(length != 1 for length in metadata.extend_lens):
            raise ValueError("plan_cuda_graph takes decode-only batches")
        self._plan_decode(wrappers, metadata, self._graph_ring_locs)

    # -- per layer --------------------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        window = self.windows[layer]
        kv_locs = self._kv_locs[self.in_ring(window)]
        self.kv_cache.k_flat[layer].index_copy_(0, kv_locs, k)
        self.kv_cache.v_flat[layer].index_copy_(0, kv_locs, v)
        wrapper, pools = self._wrappers[self.windows[layer]], (self.kv_cache.k[layer], self.kv_cache.v[layer])
        if sinks is None:
            return wrapper.run(q.contiguous(), pools)
        out, lse = wrapper.run(q.contiguous(), pools, return_lse=True)
        return with_sinks(out, lse, sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output `out` [T, H, D] as if each head's sink logit had joined its softmax: the keys' share
    of the total, sum(exp(s)) / (sum(exp(s)) + exp(sink)), is sigmoid(lse - sink) with `lse` [T, H] the
    scores' log-sum-exp (flashinfer's in base 2). Any kernel that returns the lse takes sinks this way."""
    share = torch.sigmoid(lse.float() * LN2 - sinks.float())
    return (out.float() * share[..., None]).to(out.dtype)
