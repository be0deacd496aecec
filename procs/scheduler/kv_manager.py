"""The KV pages of admitted requests: what admission reserves, preemption when an estimate proves
short, and the pages each planned step writes into.

SCHEDULING.md counts token positions (page size 1); here they are whole pages. For an admitted r,
    reservation(r) = ceil(T(r) / page_size) pages,  T(r) = max(kv_len, prompt_len) + est_future(r),
which is `allocated(r) + est(r)`: the KV it holds plus the prompt tokens still to prefill plus
est_future(r) = ceil(rho * (max_tokens - generated)). A waiting request X fits when a slot is free and
    reservation(X) + sum of reservation(r) over admitted r <= usable pages.
With rho = 1 that is the chapter's worst case: reservations only shrink and no step can run out of
pages. With rho < 1 a request can outgrow its estimate, and step 3b preempts the most recently
admitted requests until the pages the planned step needs fit in the pool.

With the prefix cache, a request starts on the cached pages of its prompt's longest cached prefix
(`attach`), its completed prompt pages join the cache as its prefill goes (`cache_prompt_pages`),
and all its completed pages when it ends. Its reservation then leaves out the cache pages it uses
(`shared_pages`): those are counted once, as the cache's referenced pages, however many requests
share them, and cache pages nobody references count as free (they are evicted, least recently used
first, when an allocation needs them). With the cache off or empty, every number above is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, overload

import numpy as np

from batchserve.procs.scheduler.config import SchedulerConfig
from batchserve.procs.scheduler.kv_allocator import KVAllocatorError, PageAllocator
from batchserve.procs.scheduler.prefix_cache import CachedPage, PrefixCache
from batchserve.procs.scheduler.request import Request
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.shared.ranges import concat_ranges

_EMPTY = np.zeros(0, dtype=np.int64)


class PageTableUpdates(NamedTuple):
    """New page-table entries: `page_table[slots[j], cols[j]] = pages[j]` (what the worker applies)."""

    slots: np.ndarray
    cols: np.ndarray
    pages: np.ndarray


NO_UPDATES = PageTableUpdates(_EMPTY, _EMPTY, _EMPTY)


class KVManager:
    def __init__(self, config: SchedulerConfig, table: RequestTable) -> None:
        self.page_size = config.page_size
        self.num_pages = config.num_kv_pages
        self.reserve_percent = config.kv_reserve_percent
        self.allocator = PageAllocator(self.num_pages)
        self.table = table
        self.cache = PrefixCache(self.page_size, config.state_snapshots) if config.prefix_cache else None
        self.rope_switch_length = config.rope_switch_length
        self.rope_dynamic_length = config.rope_dynamic_length
        self.window = config.sliding_window
        self.prefill_budget = config.prefill_budget
        # Tokens at the end of a request's KV that a draft model may not hold yet: the last draft token
        # of a row accepted whole is fed to the draft only with the request's next row
        # (procs/worker/speculation/draft_model.py), so a request released after such a row leaves its page out of
        # the cache (a later request would read a draft KV the draft never wrote there).
        self.draft_lag = 1 if config.speculative == "draft" else 0
        self._attached: list[PageTableUpdates] = []  # cached pages of new admissions, for the next batch
        self.hit_tokens = 0  # prompt tokens found in the cache at admissions (counters for /metrics)
        self.queried_tokens = 0
        self.evicted_pages = 0

    @overload
    def pages_for(self, tokens: int) -> int: ...
    @overload
    def pages_for(self, tokens: np.ndarray) -> np.ndarray: ...
    def pages_for(self, tokens: int | np.ndarray) -> int | np.ndarray:
        return -(-tokens // self.page_size)

    def future_estimate(self, remaining: int | np.ndarray) -> int | np.ndarray:
        """ceil(rho * remaining) in integers, exactly as SCHEDULING.md computes it."""
        return (self.reserve_percent * remaining + 99) // 100

    # ---------------------------------------------------------------- admission
    def lookup(self, request: Request) -> list[CachedPage]:
        """The cached pages its prompt starts with (at least its last prompt token is left to compute)."""
        if self.cache is None or request.wants_prompt_logprobs:  # cached positions would have no logits
            return []
        path = self.cache.match(
            request.prompt, (request.prompt_len - 1) // self.page_size, self.cache_namespace(request)
        )
        served = self.cache.with_state(path)
        # a hybrid model's: where its prompt leaves the tree (another prompt goes on there) its state is kept too
        request.save_at = (len(path) * self.page_size,) if len(path) > len(served) else ()
        return served

    def cache_namespace(self, request: Request) -> bytes:
        """The prefix cache's namespace of `request`: requests share cached KV only within one. The one
        place a request's KV-shaping fields join the cache key: the rope regime (a prompt longer than
        `rope_switch_length` computes every key with the long factors, and with dynamic NTK one longer than
        `rope_dynamic_length` with frequencies of its own length, `kernels.rope`), and the LoRA adapter (its
        projections make other KV of the same tokens). A pooling request joins here too."""
        adapter = b"lora:%d|" % request.params.adapter if request.params.adapter else b""  # its own weights' KV
        if self.rope_switch_length and request.prompt_len > self.rope_switch_length:
            return adapter + b"rope:long"
        if self.rope_dynamic_length and request.num_prompt_tokens > self.rope_dynamic_length:
            return (
                adapter + b"rope:length:%d" % request.num_prompt_tokens
            )  # the client's: a recompute's keys are the same
        return adapter

    def reservation(self, request: Request, cached: Sequence[CachedPage] = ()) -> int:
        """Pages admitting a waiting request adds to the reserved total: its own (the prompt past the
        cached prefix, and the estimated future), plus the cached pages nobody referenced yet."""
        tokens = request.prompt_len + self.future_estimate(request.max_tokens - request.num_generated_before)
        own = int(self.pages_for(self.windowed(tokens, request.prompt_len))) - len(cached)
        return own + sum(1 for node in cached if node.refs == 0)

    def reserved_pages(self) -> int:
        """Sum of reservation(r) over the admitted requests, from the request table's columns, plus the
        cache pages they use (counted once however many share them)."""
        own = self.own_reservation(self.table.admit_seq >= 0)
        return own + (self.cache.num_referenced if self.cache is not None else 0)

    def own_reservation(self, slots: int | np.ndarray) -> int:
        """The reserved pages of the requests in `slots` (a slot, or a mask or index of them) that are
        theirs alone: held or to come, less the cached pages they use."""
        t = self.table
        tokens = np.maximum(t.kv_len[slots], t.prompt_len[slots]) + self.future_estimate(
            t.token_limit[slots] - t.generated[slots]
        )
        tokens = self.windowed(tokens, np.maximum(t.prompt_len[slots] - t.kv_len[slots], 0))
        return int(np.sum(self.pages_for(tokens))) - int(np.sum(t.shared_pages[slots]))

    def windowed(self, tokens: int | np.ndarray, to_prefill: int | np.ndarray) -> int | np.ndarray:
        """`tokens` of KV to hold, as a sliding window W bounds them: at most a window and a page, and while
        prompt is left to prefill, the next chunk (at most the prefill budget) too. Without a window, `tokens`."""
        if not self.window:
            return tokens
        return np.minimum(tokens, self.window + self.page_size + np.minimum(to_prefill, self.prefill_budget))

    def max_decoding_pages(self) -> int:
        """The most pages one decoding request holds now (its own, dropped ones left out)."""
        t = self.table
        decoding = (t.admit_seq >= 0) & (t.kv_len >= t.prompt_len)
        held = t.num_pages[decoding] - t.dropped_pages[decoding]
        return int(held.max()) if held.shape[0] else 0

    def drop_out_of_window(self) -> int:
        """With a sliding window W: every admitted request's pages wholly before its last W positions
        (less one, for a step still in flight) go back to the pool, their page-table entries to page 0
        (sent with the next batch). Returns the pages given back."""
        if not self.window:
            return 0
        t, size = self.table, self.page_size
        slots = np.flatnonzero(t.admit_seq >= 0)
        dead = np.maximum(t.kv_len[slots] - self.window, 0) // size
        count = dead - t.dropped_pages[slots]
        rows = np.flatnonzero(count > 0)
        if not rows.shape[0]:
            return 0
        slots, first, count = slots[rows], t.dropped_pages[slots[rows]], count[rows]
        total = int(count.sum())
        rows_of = np.repeat(slots, count)
        cols = concat_ranges(first, count)
        self.allocator.free(t.page_table[rows_of, cols])
        t.page_table[rows_of, cols] = 0
        t.dropped_pages[slots] += count
        self._attached.append(PageTableUpdates(rows_of, cols, np.zeros(total, dtype=np.int32)))
        return total

    def attach(self, request: Request, cached: list[CachedPage]) -> None:
        """An admitted request starts on `cached`: they become its first pages, already computed."""
        request.restore_state = -1
        if self.cache is None:
            return
        self.queried_tokens += request.prompt_len
        if not cached:
            return
        self.cache.reference(cached)
        request.cache_path = list(cached)
        request.restore_state = cached[-1].state  # a hybrid model's state at the prefix's end (-1: none)
        t, slot, m = self.table, request.slot, len(cached)
        pages = np.fromiter((node.page for node in cached), dtype=np.int32, count=m)
        t.ensure_columns(m)
        t.page_table[slot, :m] = pages
        t.num_pages[slot] = t.shared_pages[slot] = m
        t.kv_len[slot] = request.prefilled = m * self.page_size
        self.hit_tokens += m * self.page_size
        self._attached.append(PageTableUpdates(np.full(m, slot, dtype=np.int64), np.arange(m, dtype=np.int64), pages))

    def cache_prompt_pages(self, request: Request) -> tuple[int, int] | None:
        """After a prefill chunk: the prompt's newly completed full pages join the cache. A hybrid model's
        request whose chunk ended at its snapshot boundary (`chunk_limit`): (slot, snapshot) its state is
        saved to after the step, now held by the boundary's node (None: nothing to save)."""
        if self.cache is None:
            return None
        self._insert(request, request.prefilled // self.page_size, request.prompt)
        snapshots, pages = self.cache.snapshots, request.prefilled // self.page_size
        if snapshots is None or not pages or request.prefilled not in self.snapshot_boundaries(request):
            return None
        # the boundary's node: its own page's, or an earlier prompt's with the same tokens (the same state)
        path = self.cache.match(request.prompt, pages, self.cache_namespace(request))
        if len(path) != pages or path[-1].state >= 0:
            return None
        return request.slot, snapshots.take(path[-1])

    def snapshot_boundaries(self, request: Request) -> tuple[int, ...]:
        """A hybrid model's: the prompt positions whose states snapshots keep: where its prompt left the
        cached tree at admission (a prefix other prompts share), and the end of the longest prefix `lookup`
        could serve a later request with this prompt."""
        return (*request.save_at, (request.prompt_len - 1) // self.page_size * self.page_size)

    def chunk_limit(self, request: Request) -> int:
        """The most prompt tokens its next chunk may take: the rest of its prompt, or with state snapshots
        up to its next snapshot boundary, where its state is saved (SCHEDULING.md 5)."""
        rest = request.prompt_len - request.prefilled
        if self.cache is None or self.cache.snapshots is None:
            return rest
        return min([b - request.prefilled for b in self.snapshot_boundaries(request) if b > request.prefilled] + [rest])

    def _insert(self, request: Request, pages: int, tokens: np.ndarray) -> None:
        """Its pages `len(cache_path)..pages-1` (whose KV is computed) join the cache, extending its path.

        A page someone else cached first stays its own (a duplicate); its path goes on through that
        node only if others use it, so that referencing it never pins a page the cache could free."""
        cache = self.cache
        assert cache is not None
        path = request.cache_path
        first = len(path)
        if pages <= first:
            return
        t, slot = self.table, request.slot
        parent = path[-1] if path else cache.root(self.cache_namespace(request))
        row = t.page_table[slot]
        for col, key in enumerate(cache.page_keys(tokens, first, pages), first):
            node, created = cache.insert(parent, key, int(row[col]))
            if created:
                t.shared_pages[slot] += 1
            elif node.refs == 0:
                return
            cache.reference((node,))
            path.append(node)
            parent = node

    # ---------------------------------------------------------------- a planned step
    def growth(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Pages each planned item adds: pages for its KV after the step, minus the pages it holds."""
        t = self.table
        return self.pages_for(t.kv_len[slots] + tokens) - t.num_pages[slots]

    def preemption_victims(self, slots: np.ndarray, growth: np.ndarray, by_priority: bool = False) -> list[int]:
        """SCHEDULING.md step 3b: while the pages held plus the planned growth exceed the pool, the
        most recently admitted request goes (its pages and its planned growth with it); `by_priority`:
        the lowest-priority one, among equals the most recently admitted (section 8).

        Returns the victims' slots in preemption order; [] in the common case, at the cost of a sum.
        """
        evictable = self.cache.num_evictable if self.cache is not None else 0
        excess = self.allocator.num_used - evictable + int(growth.sum()) - self.num_pages
        if excess <= 0:
            return []
        t = self.table
        planned = np.zeros(t.num_slots, dtype=np.int64)
        planned[slots] = growth

        def rank(slot: int) -> tuple[int, int]:
            request = t.requests[slot]
            return (request.params.priority if by_priority and request is not None else 0), int(t.admit_seq[slot])

        order = sorted(np.flatnonzero(t.admit_seq >= 0).tolist(), key=rank)  # the next victim last
        victims: list[int] = []
        while excess > 0:
            if not order:  # the oldest request alone always fits: unreachable unless accounting broke
                raise KVAllocatorError(f"preempting every request leaves {excess} pages short")
            slot = order.pop()
            victims.append(slot)
            # Its own pages and planned growth, and the cache pages only it uses (they become evictable).
            request = t.requests[slot]
            sole = self.cache.sole_references(request.cache_path) if self.cache is not None and request else 0
            excess -= int(t.num_pages[slot] - t.dropped_pages[slot] - t.shared_pages[slot] + planned[slot]) + sole
        return victims

    def allocate(self, slots: np.ndarray, growth: np.ndarray) -> PageTableUpdates:
        """Give each planned item its `growth` new pages, appended to its row of the page table."""
        t = self.table
        have = t.num_pages[slots]
        if growth.shape[0] and int(growth.max()) <= 1:  # decode steps: at most one new page per item
            grows = growth.astype(bool)
            new_slots, new_cols = slots[grows], have[grows]
            total = int(new_slots.shape[0])
        else:
            total = int(growth.sum())
            new_slots = np.repeat(slots, growth)
            new_cols = concat_ranges(have, growth)
        attached, self._attached = self._attached, []
        if not total:
            return _joined(attached) if attached else NO_UPDATES
        if total > self.allocator.num_free and self.cache is not None:
            evicted = self.cache.evict(total - self.allocator.num_free)
            self.evicted_pages += int(evicted.shape[0])
            self.allocator.free(evicted)
        pages = self.allocator.alloc(total)
        t.ensure_columns(int(new_cols.max()) + 1)
        t.page_table[new_slots, new_cols] = pages
        t.num_pages[slots] = have + growth
        return _joined([*attached, PageTableUpdates(new_slots, new_cols, pages)])

    def truncate(self, slots: np.ndarray) -> None:
        """Give back each slot's own pages past its KV (a speculative row's rejected tokens had them)."""
        t = self.table
        keep = self.pages_for(t.kv_len[slots])
        extra = t.num_pages[slots] - keep
        rows = np.flatnonzero(extra > 0)
        if not rows.shape[0]:
            return
        slots, keep, extra = slots[rows], keep[rows], extra[rows]
        cols = concat_ranges(keep, extra)
        self.allocator.free(t.page_table[np.repeat(slots, extra), cols])
        t.num_pages[slots] = keep

    def release(self, requests: list[Request]) -> None:
        """Empty their table rows and give back their pages. With the cache, their completed pages join
        it first (prompt and generated tokens; a partial last page stays out), and only the pages the
        cache did not take go back to the allocator."""
        slots = np.fromiter((r.slot for r in requests), dtype=np.int64, count=len(requests))
        # updates not sent yet for these rows are void: the next request in a slot writes its own
        self._attached = [
            PageTableUpdates(*(a[keep] for a in u)) for u in self._attached if (keep := ~np.isin(u.slots, slots)).any()
        ]
        cache = self.cache
        if cache is None:
            self.allocator.free(self.table.release(slots))
            return
        t = self.table
        for request in requests:
            slot = request.slot
            done = request.num_generated_before
            outputs = t.output_ids[slot, done : t.generated[slot]]
            computed = int(t.kv_len[slot]) - self.draft_lag
            self._insert(request, computed // self.page_size, np.concatenate([request.prompt, outputs]))
        cached = np.fromiter((node.page for r in requests for node in r.cache_path), dtype=np.int32)
        pages = t.release(slots)
        self.allocator.free(pages[~np.isin(pages, cached)])
        for request in requests:
            cache.dereference(request.cache_path)
            request.cache_path = []


def _joined(parts: list[PageTableUpdates]) -> PageTableUpdates:
    if len(parts) == 1:
        return parts[0]
    return PageTableUpdates(*(np.concatenate([getattr(p, f) for p in parts]) for f in PageTableUpdates._fields))
