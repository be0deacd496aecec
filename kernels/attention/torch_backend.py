"""Attention in plain torch, for any device; the reference the tests trust.

Per step, `plan()` turns the batch into index tensors once:
- decode rows (extend_len 1) are batched together: their pages are gathered through the page table
  into a padded `[b, max_pages * page_size]` key/value tensor (padding reads the dummy page) with a
  length mask. A short row after a cached prefix (a decode row with a draft, up to
  `MAX_DECODE_ROW_TOKENS`) joins them as one decode row per token, token j attending to the prefix
  and the row's first j + 1 tokens: causal attention exactly, since every layer writes the whole
  step's k/v before it attends;
- prefill chunks run one request at a time through `F.scaled_dot_product_attention` (a varlen kernel
  does not exist on CPU): a fresh prompt attends causally to its own k/v directly, a later chunk
  attends to its cached prefix plus the causal part of the chunk, gathered through the page table.
Every layer then writes its new k/v into the pool at `kv_locs` and attends. A sliding-window layer
attends through masks that also drop the keys W or more positions back: `plan()` makes one `StepPlan`
per distinct window of the model's layers (the pages gathered once for all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchserve.kernels.attention.base import AttentionBackend, AttentionMetadata

# A row of at most this many tokens after a cached prefix attends as decode rows (see above): the
# widest decode row speculative decoding sends, with room; prefill chunks are longer as a rule, and
# compute-bound, where SDPA's blocked kernel is the better one.
MAX_DECODE_ROW_TOKENS = 16


@dataclass
class _PrefillChunk:
    start: int  # first row in the packed arrays
    length: int
    pages: torch.Tensor | None  # [pages] holding the prefix + chunk; None: attend to the chunk's own k/v
    mask: torch.Tensor | None  # [length, keys] bool, True = may attend
    # In a ring: the pages hold the window before the chunk, its `pool_keys` tokens from `offset` on, and the
    # chunk's own k/v follow them (written to the ring only after: it may not hold the window and the chunk)
    pool_keys: int = 0
    offset: int = 0
    # Paged (`CpuAttentionBackend`): the chunk's k/v are in the pool before it attends, `pages` hold the prefix and
    # the chunk, and a C kernel reads them there (no mask: causal by position, in the layers' `window`)
    paged: bool = False
    prefix: int = 0
    window: int = 0


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # packed rows of the decode tokens; None: all rows, in order
    pages: torch.Tensor  # [b, max_pages] int64 pages of each row (dummy page 0 past its length)
    lens: torch.Tensor  # [b] int64 tokens each row attends to (its cached prefix and itself)
    mask: torch.Tensor | None  # [b, 1, 1, max_pages * page_size] additive: 0 = may attend, -inf = masked
    window: int = 0  # a sliding window: each row attends to its last `window` tokens only


class _DecodeRows(NamedTuple):
    """A step's decode rows before their pages are gathered."""

    rows: torch.Tensor | None  # packed rows of the decode tokens; None: all rows, in order
    slots: torch.Tensor  # [b] int64 each row's slot
    lens: torch.Tensor  # [b] int64 tokens each row attends to (its cached prefix and itself)
    longest: int  # the most of them


@dataclass
class StepPlan:
    """How the layers of one window (0: none) attend this step, and where their new K/V go."""

    decode: DecodeGroup | None
    prefills: list[_PrefillChunk]
    kv_locs: torch.Tensor
    write_first: torch.Tensor | None = None  # the rows written before attending (None: all of them)
    write_after: torch.Tensor | None = None  # the rows written after (ring chunks after a prefix; None: none)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    ring_row_tokens = MAX_DECODE_ROW_TOKENS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plans: dict[int, StepPlan] = {}  # by window

    # -- per step ---------------------------------------------------------------------------------

    def plan(self, metadata: AttentionMetadata) -> None:
        chunks, decode = self._sort_rows(metadata)
        tables = {  # the pages each table gives, once
            ring: self._table_pages(ring, metadata, chunks, decode) for ring in {self.in_ring(w) for w in self.windows}
        }
        self._plans = {}
        for window in set(self.windows):
            kv_locs, chunk_pages, decode_pages = tables[self.in_ring(window)]
            decode_group = None
            if decode is not None:
                assert decode_pages is not None  # every table gives the decode rows' pages when there are some
                decode_group = self._plan_decode(decode.rows, decode_pages, decode.lens, window)
            if self.in_ring(window):
                self._plans[window] = self._ring_plan(decode_group, chunks, kv_locs, window, metadata.num_tokens)
                continue
            self._plans[window] = StepPlan(
                decode_group,
                [
                    self._pool_chunk(start, length, prefix, pages, window)
                    for (start, length, prefix, _), pages in zip(chunks, chunk_pages)
                ],
                kv_locs,
            )

    def _sort_rows(self, metadata: AttentionMetadata) -> tuple[list[tuple[int, int, int, int]], _DecodeRows | None]:
        """The step's prefill chunks, (start, length, prefix, slot) each, and its decode rows (None: none):
        one row per token of a short row after a cached prefix (see the module's docstring)."""
        device = self.kv_cache.device
        chunks: list[tuple[int, int, int, int]] = []  # (start, length, prefix, slot)
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        decode_lens: list[int] = []
        widths: list[tuple[int, int]] = []  # (prefix, length) of the decode rows: what a ring must hold
        start = 0
        for slot, prefix, length in zip(metadata.slots, metadata.prefix_lens, metadata.extend_lens):
            if length == 1 or prefix and length <= MAX_DECODE_ROW_TOKENS:
                decode_rows.extend(range(start, start + length))
                decode_slots.extend([slot] * length)
                decode_lens.extend(range(prefix + 1, prefix + length + 1))
                widths.append((prefix, length))
            else:  # a fresh prompt attends to its own k/v, a later chunk to its pages too
                chunks.append((start, length, prefix, slot))
            start += length
        if self.kv_cache.ring_pages and widths:
            self.kv_cache.check_ring_rows(*zip(*widths))
        if not decode_rows:
            return chunks, None
        all_rows = len(decode_rows) == metadata.num_tokens  # decode-only step: no row gather needed
        return chunks, _DecodeRows(
            None if all_rows else torch.tensor(decode_rows, dtype=torch.int64, device=device),
            torch.tensor(decode_slots, dtype=torch.int64, device=device),
            torch.tensor(decode_lens, dtype=torch.int64, device=device),
            max(decode_lens),
        )

    def _table_pages(
        self,
        ring: bool,
        metadata: AttentionMetadata,
        chunks: list[tuple[int, int, int, int]],
        decode: _DecodeRows | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
        """What the ring's table (`ring`) or the pool's gives the step: the new tokens' KV locations, the
        pages of each chunk outside a ring, and the decode rows' pages (None: no decode rows)."""
        table = self._table(ring)
        kv_locs = metadata.kv_locs
        if ring:
            locs = self.kv_cache.ring_locs(
                metadata.slots, metadata.prefix_lens, metadata.extend_lens, metadata.num_padding
            )
            kv_locs = torch.from_numpy(locs).to(self.kv_cache.device)
        chunk_pages = (
            [self._chunk_pages(slot, prefix, length, table) for _, length, prefix, slot in chunks] if not ring else []
        )
        decode_pages = None
        if decode is not None:
            decode_pages = self._pages(decode.slots, decode.lens, decode.longest, table)
            if metadata.num_padding:  # padded rows (the last decode rows) read only the dummy page
                decode_pages[-metadata.num_padding :] = 0
        return kv_locs, chunk_pages, decode_pages

    def _table(self, ring: bool) -> torch.Tensor:
        """The page table of the ring layers (`ring`) or of the others."""
        if not ring:
            return self.kv_cache.page_table
        assert self.kv_cache.ring_table is not None  # `in_ring` holds only for a pool with rings
        return self.kv_cache.ring_table

    def _ring_plan(
        self,
        decode: DecodeGroup | None,
        chunks: list[tuple[int, int, int, int]],
        kv_locs: torch.Tensor,
        window: int,
        num_tokens: int,
    ) -> StepPlan:
        """A ring's layers: a chunk after a prefix attends to the window before it, from the ring's pages, and
        to its own k/v, which are written after (a ring holds the window and a decode row, not a chunk)."""
        device, size, table = self.kv_cache.device, self.kv_cache.page_size, self._table(ring=True)
        prefills, after = [], []
        for start, length, prefix, slot in chunks:
            if not prefix:
                prefills.append(self._prefill_chunk(start, length, 0, None, window))
                continue
            first = max(prefix - window + 1, 0)
            pages = table[slot, first // size : (prefix - 1) // size + 1].to(torch.int64)
            chunk = self._prefill_chunk(start, length, prefix, pages, window, first_key=first)
            chunk.pool_keys, chunk.offset = prefix - first, first % size
            prefills.append(chunk)
            after.append(torch.arange(start, start + length, device=device))
        if not after:
            return StepPlan(decode, prefills, kv_locs)
        write_after = torch.cat(after)
        keep = torch.ones(num_tokens, dtype=torch.bool, device=device)
        keep[write_after] = False
        return StepPlan(decode, prefills, kv_locs, keep.nonzero().flatten(), write_after)

    def _chunk_pages(self, slot: int, prefix: int, length: int, table: torch.Tensor) -> torch.Tensor | None:
        """The pages a chunk outside a ring reads: its prefix's (None: a fresh prompt attends to its own k/v)."""
        if not prefix:
            return None
        device = table.device
        return self._pages(
            torch.tensor([slot], device=device), torch.tensor([prefix + length], device=device), prefix + length, table
        )[0]

    def _pool_chunk(
        self, start: int, length: int, prefix: int, pages: torch.Tensor | None, window: int
    ) -> _PrefillChunk:
        """A chunk outside a ring, after its k/v are written to the pool."""
        return self._prefill_chunk(start, length, prefix, pages, window)

    def _prefill_chunk(
        self, start: int, length: int, prefix: int, pages: torch.Tensor | None, window: int, first_key: int = 0
    ) -> _PrefillChunk:
        """A chunk's rows attending to the positions from `first_key` to its own: causally, in a window."""
        if not self.causal:  # an encoder's whole input (never after a prefix): every token sees every other
            assert not prefix, "a bidirectional row is a whole input"
            return _PrefillChunk(
                start, length, None, torch.ones(length, length, dtype=torch.bool, device=self.kv_cache.device)
            )
        if pages is None and not window:
            return _PrefillChunk(start, length, None, None)  # SDPA's causal mask
        device = self.kv_cache.device
        query = torch.arange(prefix, prefix + length, device=device)[:, None]
        keys = torch.arange(first_key, prefix + length, device=device)[None, :]
        mask = keys <= query
        if window:
            mask &= keys > query - window
        return _PrefillChunk(start, length, pages, mask)

    def _plan_decode(
        self, rows: torch.Tensor | None, pages: torch.Tensor, lens: torch.Tensor, window: int
    ) -> DecodeGroup:
        positions = torch.arange(pages.shape[1] * self.kv_cache.page_size, device=pages.device)[None, :]
        valid = positions < lens[:, None]
        if window:
            valid &= positions >= lens[:, None] - window
        # an additive float mask: SDPA's CPU kernel runs it a little faster than a boolean one
        mask = torch.zeros(valid.shape, dtype=self.kv_cache.dtype, device=pages.device).masked_fill_(
            ~valid, float("-inf")
        )
        return DecodeGroup(rows, pages, lens, mask[:, None, None, :], window)

    def _pages(self, slots: torch.Tensor, lens: torch.Tensor, max_len: int, table: torch.Tensor) -> torch.Tensor:
        """Pages [len(slots), ceil(max_len / page_size)] holding each slot's first `lens` tokens, by `table`.

        Gathering whole pages is far cheaper on CPU than gathering token rows; columns past a
        request's own pages point at the dummy page so stale page-table entries are never read.
        """
        page_size = self.kv_cache.page_size
        num_cols = -(-max_len // page_size)
        pages = table[slots, :num_cols].to(torch.int64)
        cols = torch.arange(num_cols, device=pages.device)[None, :]
        return torch.where(cols * page_size < lens[:, None], pages, 0)

    def _gather(self, pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Tokens of the given pages: [*pages.shape[:-1], num_cols * page_size, kv_heads, head_dim]."""
        tokens = pool.index_select(0, pages.reshape(-1))
        return tokens.view(*pages.shape[:-1], pages.shape[-1] * pool.shape[1], *pool.shape[2:])

    # -- per layer --------------------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        plan = self._plans[self.windows[layer]]
        self._write_kv(k, v, layer, plan.kv_locs, plan.write_first)
        k_pool = self.kv_cache.k[layer]  # [num_pages, page_size, kv_heads, head_dim]
        v_pool = self.kv_cache.v[layer]
        decode = plan.decode
        if decode is not None and decode.rows is None:
            return self._attend_decode(q, k_pool, v_pool, decode, sinks)
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.rows] = self._attend_decode(q[decode.rows], k_pool, v_pool, decode, sinks)
        for chunk in plan.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            self._attend_chunk(q[rows], k[rows], v[rows], k_pool, v_pool, chunk, sinks, out[rows])
        if plan.write_after is not None:
            self._write_kv(k, v, layer, plan.kv_locs, plan.write_after)
        return out

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
        """A prefill chunk's rows (q, and its own k/v) attending as `chunk` plans, into `out` (its rows)."""
        if chunk.pages is None:
            keys, values = k, v
        elif chunk.pool_keys:
            pooled = slice(chunk.offset, chunk.offset + chunk.pool_keys)
            keys = torch.cat((self._gather(k_pool, chunk.pages)[pooled], k))
            values = torch.cat((self._gather(v_pool, chunk.pages)[pooled], v))
        else:
            assert chunk.mask is not None  # a chunk that reads pages attends through a mask (`_prefill_chunk`)
            total = chunk.mask.shape[1]
            keys = self._gather(k_pool, chunk.pages)[:total]
            values = self._gather(v_pool, chunk.pages)[:total]
        sink = None if sinks is None else sinks[:, None, None]  # [heads, 1, 1]
        attended = self._sdpa(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], chunk.mask, sink
        )
        out.copy_(attended[0].transpose(0, 1))

    def _write_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, kv_locs: torch.Tensor, rows: torch.Tensor | None = None
    ) -> None:
        """The new K/V of `rows` (None: all) into the pool at their `kv_locs`."""
        if rows is not None:
            k, v, kv_locs = k[rows], v[rows], kv_locs[rows]
        self.kv_cache.k_flat[layer].index_copy_(0, kv_locs, k)
        self.kv_cache.v_flat[layer].index_copy_(0, kv_locs, v)

    def _attend_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        decode: DecodeGroup,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        keys = self._gather(k_pool, decode.pages).transpose(1, 2)  # [b, kv_heads, max_len, head_dim]
        values = self._gather(v_pool, decode.pages).transpose(1, 2)
        # One query token per row, so the query heads sharing a kv head can stand in for query
        # positions under the same mask: GQA without repeating every key and value per query head.
        b, heads, head_dim = q.shape
        grouped = q.view(b, self.num_kv_heads, heads // self.num_kv_heads, head_dim)
        sink = None if sinks is None else sinks.view(self.num_kv_heads, -1, 1)  # a query head's: by (kv head, group)
        return self._sdpa(grouped, keys, values, decode.mask, sink).reshape(b, heads, head_dim)

    def _sdpa(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """SDPA over [B, heads, L, D] (keys' heads may be fewer: grouped); `mask` boolean (True = may attend)
        or additive, None = causal; `sink` [heads, L or 1, 1]: a logit per query joining the softmax. Soft-capped
        scores and sinks have no SDPA kernel: transformers' eager arithmetic."""
        if not self.softcap and sink is None:
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
        group = q.shape[1] // keys.shape[1]
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if sink is None:
            return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), values)
        sinks = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, sinks), dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(q.dtype), values)
