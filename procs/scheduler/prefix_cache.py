"""The prefix cache: a radix tree from token ids to the KV pages that hold them, one node per full page.

A node stands for one page of `page_size` tokens, keyed by those tokens, below the node of the page
before it; so a root-to-node path is a token prefix and its pages hold that prefix's KV (which only
depends on the tokens before it). Only full pages are cached: a request's partial last page stays
its own. Requests reference the nodes of the prefix they use (`refs`); a referenced node and its
ancestors are never evicted. Referenced nodes always form paths from the root (a request references
every node on its path), so every unreferenced node can be evicted, leaves first, least recently
used first.

A namespace keeps apart requests whose KV differs for the same tokens (a rope regime, later an
adapter): each namespace has its own root (`root`), and a prefix matches only within its own.

A hybrid model (linear-attention layers beside full ones) can start a request after a cached prefix only
where the linear layers' state at the prefix's end was kept: `StateSnapshots` gives such nodes one of the
worker's state snapshots (`node.state`), least recently used out first, and the cache serves a hybrid
request the deepest node of its match that has one (SCHEDULING.md 5).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class CachedPage:
    __slots__ = ("key", "page", "parent", "children", "refs", "last_used", "state")

    def __init__(self, key: bytes, page: int, parent: CachedPage | None) -> None:
        self.key = key  # the page's token ids (int32 bytes)
        self.page = page  # KV page id
        self.parent = parent
        self.children: dict[bytes, CachedPage] = {}
        self.refs = 0  # requests using this page's KV (through their path)
        self.last_used = 0
        self.state = -1  # a hybrid model's state snapshot at this page's end (`StateSnapshots`); -1: none

    def __repr__(self) -> str:
        return f"CachedPage(page={self.page}, refs={self.refs}, children={len(self.children)})"


class StateSnapshots:
    """The worker's `count` state snapshots, each held by one cached node, least recently used out first."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count - 1, -1, -1))
        self._held: OrderedDict[int, CachedPage] = OrderedDict()  # snapshot -> node, least recently used first

    def take(self, node: CachedPage) -> int:
        """A snapshot for `node`'s state (a free one, else the least recently used, taken from its node)."""
        if self._free:
            snapshot = self._free.pop()
        else:
            snapshot, old = self._held.popitem(last=False)
            old.state = -1
        self._held[snapshot] = node
        node.state = snapshot
        return snapshot

    def used(self, node: CachedPage) -> None:
        self._held.move_to_end(node.state)

    def release(self, node: CachedPage) -> None:
        """`node` leaves the cache: its snapshot is free again."""
        if node.state >= 0:
            del self._held[node.state]
            self._free.append(node.state)
            node.state = -1


class PrefixCache:
    def __init__(self, page_size: int, state_snapshots: int = 0) -> None:
        self.page_size = page_size
        self.snapshots = StateSnapshots(state_snapshots) if state_snapshots else None
        self.roots: dict[bytes, CachedPage] = {}  # by namespace
        self.num_pages = 0  # pages the tree holds
        self.num_referenced = 0  # of those, pages some request references
        self._clock = 0
        self._evictable: list[tuple[int, int, CachedPage]] = []  # (last_used, tiebreak, node) of unreferenced leaves
        self._pushes = 0

    def root(self, namespace: bytes = b"") -> CachedPage:
        """The root of `namespace`'s tree (made on first use; a root holds no page)."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = CachedPage(namespace, -1, None)
        return root

    @property
    def num_evictable(self) -> int:
        return self.num_pages - self.num_referenced

    def page_keys(self, tokens: np.ndarray, first: int, last: int) -> list[bytes]:
        """Keys of full pages `first..last-1` of `tokens`."""
        P = self.page_size
        data = np.ascontiguousarray(tokens[first * P : last * P], dtype=np.int32).tobytes()
        step = 4 * P
        return [data[i : i + step] for i in range(0, len(data), step)]

    # ---------------------------------------------------------------- lookups
    def match(self, tokens: np.ndarray, max_pages: int, namespace: bytes = b"") -> list[CachedPage]:
        """The nodes of the longest cached prefix of `tokens` in `namespace`, at most `max_pages` pages."""
        node, path = self.root(namespace), []
        for key in self.page_keys(tokens, 0, min(max_pages, len(tokens) // self.page_size)):
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def with_state(self, path: list[CachedPage]) -> list[CachedPage]:
        """With state snapshots (a hybrid model), what of a match can serve: up to its deepest node that keeps
        a state (marked used); the whole match otherwise."""
        if self.snapshots is None:
            return path
        kept = len(path)
        while kept and path[kept - 1].state < 0:
            kept -= 1
        if kept:
            self.snapshots.used(path[kept - 1])
        return path[:kept]

    # ---------------------------------------------------------------- references
    def reference(self, nodes: Sequence[CachedPage]) -> None:
        for node in nodes:
            if node.refs == 0:
                self.num_referenced += 1
            node.refs += 1

    def dereference(self, nodes: Sequence[CachedPage]) -> None:
        self._clock += 1
        for node in reversed(nodes):
            node.refs -= 1
            node.last_used = self._clock
            if node.refs == 0:
                self.num_referenced -= 1
                if not node.children:
                    self._push(node)

    def sole_references(self, nodes: Sequence[CachedPage]) -> int:
        """How many of `nodes` only one request references (they become evictable when it lets go)."""
        return sum(1 for node in nodes if node.refs == 1)

    # ---------------------------------------------------------------- insertion and eviction
    def insert(self, parent: CachedPage, key: bytes, page: int) -> tuple[CachedPage, bool]:
        """The child of `parent` for `key`: a new node holding `page` (True), or the one already there
        (False: `page` is a duplicate and stays with its owner)."""
        node = parent.children.get(key)
        if node is not None:
            return node, False
        node = CachedPage(key, page, parent)
        parent.children[key] = node
        self.num_pages += 1
        return node, True

    def evict(self, count: int) -> np.ndarray:
        """Remove up to `count` unreferenced pages, least recently used leaves first; their page ids."""
        freed: list[int] = []
        heap = self._evictable
        while len(freed) < count and heap:
            _, _, node = heapq.heappop(heap)
            if node.refs or node.children or node.parent is None:  # stale entry: used or grown since
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            if self.snapshots is not None:
                self.snapshots.release(node)
            self.num_pages -= 1
            freed.append(node.page)
            if parent.page >= 0 and parent.refs == 0 and not parent.children:  # not a root
                self._push(parent)
        return np.asarray(freed, dtype=np.int32)

    def _push(self, node: CachedPage) -> None:
        self._pushes += 1
        heapq.heappush(self._evictable, (node.last_used, self._pushes, node))

    def pages(self) -> list[int]:
        """Every cached page id (for audits)."""
        out, stack = [], [node for root in self.roots.values() for node in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node.page)
            stack.extend(node.children.values())
        return out
