"""The torch backend with attention and the KV-pool write in C (`kernels.native`): fp32 on the CPU.

Every row attends straight from the paged pool, after the layer wrote the step's k/v there: decode rows
one query each (`paged_decode_attention`: what is left is mostly reading the keys and values once), a
prefill chunk blocked like a matrix product over its prefix and itself (`paged_prefill_attention`, as fast
as SDPA's blocked kernel and without gathering the prefix into a copy). So a step of any mix is one set of
kernels, and `paged_rows` hands it to the fused decoder call (`kernels.decode_layers`) whole. The torch
backend's SDPA path stays for what the C kernels do not take: bidirectional rows (encoders) and ring layers'
chunks.
"""

from __future__ import annotations

import torch

from batchserve.kernels import native
from batchserve.kernels.attention.base import AttentionMetadata, PagedRows
from batchserve.kernels.attention.torch_backend import DecodeGroup, TorchAttentionBackend, _PrefillChunk


def _pages(chunk: _PrefillChunk) -> torch.Tensor:
    """A paged chunk's pages (the prefix's and its own: `_pool_chunk` gives a paged chunk its pages)."""
    assert chunk.pages is not None
    return chunk.pages


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.kv_cache.device.type != "cpu" or self.kv_cache.dtype != torch.float32:
            raise ValueError(
                f"the cpu attention backend runs float32 on the CPU, not "
                f"{self.kv_cache.dtype} on {self.kv_cache.device.type}"
            )
        if not native.available():
            raise native.NativeKernelError("the cpu attention backend needs the C kernels, which could not be built")
        self.paged_chunks = self.causal  # an encoder's bidirectional rows: SDPA

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        for window, plan in self._plans.items():
            native.check_locs(plan.kv_locs, self._pool_pages(window) * self.kv_cache.page_size)

    def _pool_pages(self, window: int) -> int:
        """Pages of the pool the layers of `window` keep their KV in (their ring's, or the scheduler's)."""
        return self.kv_cache.pool_pages(self.windows.index(window))

    def paged_rows(self) -> PagedRows | None:
        plan = self._plans[self.windows[0]]  # the layers' windows are the fused call's
        if self.kv_cache.ring_layers or not all(chunk.paged for chunk in plan.prefills):  # two tables, or SDPA
            return None
        decode = plan.decode
        if not plan.prefills:
            assert decode is not None  # a step has rows: without prefill chunks, decode rows
            return PagedRows(plan.kv_locs, decode.pages, decode.lens)
        # A chunk's pages lie in order from its first row on, across its rows as needed (only the chunk reads
        # them), so a long prompt's rows stay narrow; its lens say each row's position.
        rows = plan.kv_locs.shape[0]
        width = max(
            [-(-len(_pages(chunk)) // chunk.length) for chunk in plan.prefills]
            + ([decode.pages.shape[1]] if decode else [])
        )
        pages = torch.zeros((rows, width), dtype=torch.int64)
        lens = torch.ones(rows, dtype=torch.int64)
        if decode is not None:
            pages[decode.rows, : decode.pages.shape[1]] = decode.pages
            lens[decode.rows] = decode.lens
        for chunk in plan.prefills:
            chunk_pages = _pages(chunk)
            pages.view(-1)[chunk.start * width : chunk.start * width + len(chunk_pages)] = chunk_pages
            lens[chunk.start : chunk.start + chunk.length] = torch.arange(
                chunk.prefix + 1, chunk.prefix + chunk.length + 1
            )
        chunks = torch.tensor([(chunk.start, chunk.length) for chunk in plan.prefills], dtype=torch.int64)
        return PagedRows(plan.kv_locs, pages, lens, chunks[chunks[:, 0].argsort()])

    def _chunk_pages(self, slot: int, prefix: int, length: int, table: torch.Tensor) -> torch.Tensor | None:
        if not self.paged_chunks:
            return super()._chunk_pages(slot, prefix, length, table)
        return table[slot, : -(-(prefix + length) // self.kv_cache.page_size)].to(torch.int64)

    def _pool_chunk(
        self, start: int, length: int, prefix: int, pages: torch.Tensor | None, window: int
    ) -> _PrefillChunk:
        if not self.paged_chunks:
            return super()._pool_chunk(start, length, prefix, pages, window)
        assert pages is not None  # `_chunk_pages` gives a paged chunk its pool pages
        native.check_pages(
            pages[None], torch.tensor([prefix + length]), self._pool_pages(window), self.kv_cache.page_size
        )
        return _PrefillChunk(start, length, pages, None, paged=True, prefix=prefix, window=window)

    def _attend_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        chunk: _PrefillChunk,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        if not chunk.paged:
            return super()._attend_chunk(q, k, v, k_pool, v_pool, chunk, sinks, out)
        assert chunk.pages is not None  # a paged chunk's (`_pool_chunk`)
        native.paged_prefill_attention(
            q,
            k_pool,
            v_pool,
            chunk.pages,
            chunk.prefix,
            self.scale,
            window=chunk.window,
            softcap=self.softcap,
            sinks=sinks,
            out=out,
        )

    def _write_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, kv_locs: torch.Tensor, rows: torch.Tensor | None = None
    ) -> None:
        if rows is not None:
            k, v, kv_locs = k[rows], v[rows], kv_locs[rows]
        native.write_kv(self.kv_cache.k[layer], self.kv_cache.v[layer], kv_locs, k, v, locs_checked=True)

    def _plan_decode(
        self, rows: torch.Tensor | None, pages: torch.Tensor, lens: torch.Tensor, window: int
    ) -> DecodeGroup:
        native.check_pages(pages, lens, self._pool_pages(window), self.kv_cache.page_size)
        return DecodeGroup(rows, pages, lens, mask=None, window=window)

    def _attend_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        decode: DecodeGroup,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        return native.paged_decode_attention(
            q,
            k_pool,
            v_pool,
            decode.pages,
            decode.lens,
            self.scale,
            window=decode.window,
            softcap=self.softcap,
            sinks=sinks,
            pages_checked=True,
        )
