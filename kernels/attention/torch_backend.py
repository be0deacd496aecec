"""Attention in plain torch, for any device; the reference the tests trust.

Per step, `plan()` turns the batch into index tensors once:
- decode rows (extend_len 1) are batched together: their cached tokens are gathered through the page
  table into a padded `[b, max_len]` index (padding reads the dummy page) with a length mask;
- prefill chunks run one request at a time through `F.scaled_dot_product_attention` (a varlen kernel
  does not exist on CPU): a fresh prompt attends causally to its own k/v directly, a later chunk
  attends to its cached prefix plus the causal part of the chunk, gathered through the page table.
Every layer then writes its new k/v into the pool at `kv_locs` and attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class _PrefillChunk:
    start: int  # first row in the packed arrays
    length: int
    kv_index: torch.Tensor | None  # [prefix + length] flat pool indices; None: attend to the chunk's own k/v
    mask: torch.Tensor | None  # [length, prefix + length] bool, True = may attend


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # packed rows of the decode tokens; None: all rows, in order
    kv_index: torch.Tensor  # [b, max_len] flat pool indices (dummy page where masked)
    mask: torch.Tensor  # [b, 1, 1, max_len] bool, True = may attend


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kv_locs: torch.Tensor | None = None
        self._decode: _DecodeGroup | None = None
        self._prefills: list[_PrefillChunk] = []

    # -- per step ---------------------------------------------------------------------------------

    def plan(self, metadata: AttentionMetadata) -> None:
        device = self.kv_cache.device
        self._kv_locs = metadata.kv_locs
        self._prefills = []
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        decode_lens: list[int] = []
        start = 0
        for slot, prefix, length in zip(metadata.slots, metadata.prefix_lens, metadata.extend_lens):
            if length == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
                decode_lens.append(prefix + 1)
            elif prefix == 0:
                self._prefills.append(_PrefillChunk(start, length, None, None))
            else:
                total = prefix + length
                index = self._token_index(torch.tensor([slot], device=device), total)[0]
                query_pos = torch.arange(prefix, total, device=device)
                mask = torch.arange(total, device=device)[None, :] <= query_pos[:, None]
                self._prefills.append(_PrefillChunk(start, length, index, mask))
            start += length
        self._decode = None
        if decode_rows:
            all_rows = len(decode_rows) == metadata.num_tokens  # decode-only step: no row gather needed
            rows = None if all_rows else torch.tensor(decode_rows, dtype=torch.int64, device=device)
            lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
            index = self._token_index(torch.tensor(decode_slots, dtype=torch.int64, device=device), max(decode_lens))
            if metadata.num_padding:  # padded rows (the last decode rows) read only the dummy page
                index[-metadata.num_padding:] = 0
            valid = torch.arange(index.shape[1], device=device)[None, :] < lens[:, None]
            self._decode = _DecodeGroup(rows, torch.where(valid, index, 0), valid[:, None, None, :])

    def _token_index(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Flat pool indices [len(slots), length] of positions 0..length-1 of each slot's sequence."""
        page_size = self.kv_cache.page_size
        num_cols = -(-length // page_size)
        pages = self.kv_cache.page_table[slots, :num_cols].to(torch.int64)
        offsets = torch.arange(page_size, device=pages.device)
        return (pages[:, :, None] * page_size + offsets).reshape(len(slots), -1)[:, :length]

    # -- per layer --------------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_pool = self.kv_cache.k_flat[layer]
        v_pool = self.kv_cache.v_flat[layer]
        k_pool.index_copy_(0, self._kv_locs, k)
        v_pool.index_copy_(0, self._kv_locs, v)
        decode = self._decode
        if decode is not None and decode.rows is None:
            return self._attend_decode(q, k_pool, v_pool, decode)
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.rows] = self._attend_decode(q[decode.rows], k_pool, v_pool, decode)
        for chunk in self._prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            if chunk.kv_index is None:
                keys, values = k[rows], v[rows]
            else:
                keys, values = k_pool[chunk.kv_index], v_pool[chunk.kv_index]
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=self.scale, enable_gqa=True,
            )
            out[rows] = attended[0].transpose(0, 1)
        return out

    def _attend_decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       decode: _DecodeGroup) -> torch.Tensor:
        keys = k_pool[decode.kv_index].transpose(1, 2)  # [b, kv_heads, max_len, head_dim]
        values = v_pool[decode.kv_index].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=decode.mask, scale=self.scale, enable_gqa=True,
        )
        return attended[:, :, 0, :]
