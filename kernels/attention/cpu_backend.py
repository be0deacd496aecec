"""The torch backend with decode attention and the KV-pool write in C (`kernels.native`): fp32 on the CPU.

Decode rows attend straight from the paged pool instead of gathering their pages into a padded
copy and running SDPA over it: the copy goes, and what is left is mostly reading the keys and values
from memory once. Prefill chunks keep the torch backend's SDPA
path (compute-bound: SDPA's blocked kernel is the better one there).
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.attention.base import AttentionMetadata
from kernels.attention.torch_backend import DecodeGroup, TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.kv_cache.device.type != "cpu" or self.kv_cache.dtype != torch.float32:
            raise ValueError(f"the cpu attention backend runs float32 on the CPU, not "
                             f"{self.kv_cache.dtype} on {self.kv_cache.device.type}")
        if not native.available():
            raise native.NativeKernelError("the cpu attention backend needs the C kernels, which could not be built")

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        for window, plan in self._plans.items():
            native.check_locs(plan.kv_locs, self._pool_pages(window) * self.kv_cache.page_size)

    def _pool_pages(self, window: int) -> int:
        """Pages of the pool the layers of `window` keep their KV in (their ring's, or the scheduler's)."""
        return self.kv_cache.pool_pages(self.windows.index(window))

    def paged_decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        plan = self._plans[self.windows[0]]  # the layers' windows are the fused call's
        decode = plan.decode
        if decode is None or decode.rows is not None or self.kv_cache.ring_layers:  # prefill rows, or two tables
            return None
        return plan.kv_locs, decode.pages, decode.lens

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, kv_locs: torch.Tensor,
                  rows: torch.Tensor | None = None) -> None:
        if rows is not None:
            k, v, kv_locs = k[rows], v[rows], kv_locs[rows]
        native.write_kv(self.kv_cache.k[layer], self.kv_cache.v[layer], kv_locs, k, v, locs_checked=True)

    def _plan_decode(self, rows: torch.Tensor | None, pages: torch.Tensor, lens: torch.Tensor,
                     window: int) -> DecodeGroup:
        native.check_pages(pages, lens, self._pool_pages(window), self.kv_cache.page_size)
        return DecodeGroup(rows, pages, lens, mask=None, window=window)

    def _attend_decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode: DecodeGroup,
                       sinks: torch.Tensor | None) -> torch.Tensor:
        return native.paged_decode_attention(q, k_pool, v_pool, decode.pages, decode.lens, self.scale,
                                             window=decode.window, softcap=self.softcap, sinks=sinks,
                                             pages_checked=True)
