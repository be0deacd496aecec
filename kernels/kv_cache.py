"""The paged KV pool and the page table, on one device: the layout attention kernels read and write.

Per layer, K and V are `[num_pages, page_size, num_kv_heads, head_dim]`; a token's flat index is
`page * page_size + offset`. Page 0 is a dummy page: padded batch rows write there and masked-out
gathers read there, so it is never handed to a request and `kv_capacity_tokens` excludes it.
The page table `[max_running_requests, max_pages_per_request]` (int32) maps a request slot's
page-table column to its page; the scheduler decides, the worker applies the updates each step.
How many pages the worker's pool gets is the worker's choice (`procs/worker/kv_cache.py`).

Ring layers (`ring_layers`, with `ring_pages` > 0): sliding-window layers of a model that mixes them with
global ones keep only what their window reads. Each slot owns `ring_pages` pages of their own pool
(`1 + slot * ring_pages` on; page 0 the dummy page again) and a request's page-table column c lies in
ring page c mod ring_pages: a fixed `ring_table` the scheduler never touches. A step writes a request's
new tokens of its last `ring_pages` columns there (`ring_locs`; earlier ones of a long chunk go to the
dummy page), so the ring holds every position a window of W reads of a row of R tokens that attends
through it as long as ring_pages >= (W + R - 2) // page_size + 2 (`check_ring_rows`); columns further back
alias newer pages, which the window's mask hides. The backend says which rows attend through it
(`AttentionBackend.ring_row_tokens`): flashinfer's every row (a ring holds a whole step), the torch
backends' decode rows (a longer chunk reads the window before it from the ring and its own k/v beside it,
and is written after: a ring holds the window and a decode row). The scheduler's pages hold the global
layers' KV alone.

A hybrid model (Gated DeltaNet beside full attention) has pages for its full-attention layers alone and
its linear layers' per-slot states in `states` (`kernels.recurrent_state`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from batchserve.kernels.recurrent_state import RecurrentStatePool
from batchserve.shared.ranges import concat_ranges


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        max_running_requests: int,
        max_pages_per_request: int,
        dtype: torch.dtype,
        device: torch.device,
        ring_layers: Sequence[int] = (),
        ring_pages: int = 0,
        ring_window: int = 0,
        states: RecurrentStatePool | None = None,
    ):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least one page besides the dummy page 0")
        if bool(ring_layers) != (ring_pages > 0):
            raise ValueError(f"ring layers {tuple(ring_layers)} need ring_pages > 0 and the other way round")
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = device
        self.dtype = dtype
        self.ring_layers = tuple(sorted(set(ring_layers)))
        self.ring_pages = ring_pages
        self.ring_window = ring_window  # the ring layers' longest window
        self.states = states  # a hybrid model's linear layers' per-slot states (`kernels.recurrent_state`)

        def pool(layer: int) -> int:
            return 1 + max_running_requests * ring_pages if layer in self.ring_layers else num_pages

        # zeros, not empty: attention gathers whole pages and masks the unwritten tail of a request's
        # last page, and a masked 0 * NaN from uninitialised memory would still poison the row.
        def zeros(layer: int) -> torch.Tensor:
            return torch.zeros((pool(layer), page_size, num_kv_heads, head_dim), dtype=dtype, device=device)

        self.k = [zeros(layer) for layer in range(num_layers)]
        self.v = [zeros(layer) for layer in range(num_layers)]
        self.k_flat = [t.view(-1, num_kv_heads, head_dim) for t in self.k]
        self.v_flat = [t.view(-1, num_kv_heads, head_dim) for t in self.v]
        self.page_table = torch.zeros((max_running_requests, max_pages_per_request), dtype=torch.int32, device=device)
        self.ring_table = (
            None
            if not ring_pages
            else (
                1
                + torch.arange(max_running_requests, device=device)[:, None] * ring_pages
                + torch.arange(max_pages_per_request, device=device)[None, :] % ring_pages
            ).to(torch.int32)
        )

    def pool_pages(self, layer: int) -> int:
        """Pages of layer `layer`'s pool (the dummy page 0 included)."""
        return int(self.k[layer].shape[0])

    def ring_locs(
        self, slots: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int], num_padding: int = 0
    ) -> np.ndarray:
        """Where each new token of a step goes in the ring layers' pool (int64, on the host): its slot's
        ring page of its column, for the tokens of its request's last `ring_pages` columns; the dummy page for
        earlier ones and for padded rows (which come last, one token each)."""
        size, ring, real = self.page_size, self.ring_pages, len(slots) - num_padding
        extend = np.asarray(extend_lens[:real], dtype=np.int64)
        prefix = np.asarray(prefix_lens[:real], dtype=np.int64)
        positions = concat_ranges(prefix, extend)
        columns, last_columns = positions // size, np.repeat((prefix + extend - 1) // size, extend)
        locs = (1 + np.repeat(np.asarray(slots[:real], dtype=np.int64), extend) * ring + columns % ring) * size
        locs = np.where(columns > last_columns - ring, locs + positions % size, positions % size)
        return np.concatenate([locs, np.zeros(num_padding, dtype=np.int64)])

    def check_ring_rows(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        """ValueError unless every row that attends through the rings fits them: the columns of the window
        before its tokens and of its tokens (the rings are sized for the widest row)."""
        size, ring = self.page_size, self.ring_pages
        prefix, extend = np.asarray(prefix_lens, dtype=np.int64), np.asarray(extend_lens, dtype=np.int64)
        spans = (prefix + extend - 1) // size - np.maximum(prefix - self.ring_window + 1, 0) // size + 1
        if np.any(spans > ring):
            raise ValueError(
                f"a row of {int(extend[spans > ring].max())} tokens overflows the sliding layers' "
                f"rings of {ring} pages (window {self.ring_window}): they are sized for narrower rows"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the scheduler may place: every page but the dummy page 0."""
        return (self.num_pages - 1) * self.page_size

    @property
    def memory_bytes(self) -> int:
        states = 0 if self.states is None else self.states.memory_bytes
        return states + sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

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
        for name, values, bound in (
            ("slot", slots, self.max_running_requests),
            ("column", cols, self.max_pages_per_request),
            ("page", pages, self.num_pages),
        ):
            if int(values.min()) < 0 or int(values.max()) >= bound:
                raise ValueError(f"page-table {name} out of range [0, {bound}): {values.min()}..{values.max()}")
        rows = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        columns = torch.from_numpy(np.asarray(cols, dtype=np.int64)).to(self.device)
        self.page_table[rows, columns] = torch.from_numpy(np.asarray(pages, dtype=np.int32)).to(self.device)
