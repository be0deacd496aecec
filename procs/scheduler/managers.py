"""The chapter's two request pools: `PrefillManager.pending_list` and `DecodeManager.running_reqs`."""

from __future__ import annotations

from collections import deque

import numpy as np

from procs.scheduler.request import Request
from shared.messages import SamplingParams


class PrefillManager:
    """Requests whose prompt is not fully prefilled.

    `pending_list`: the waiting queue (FIFO, not admitted: no slot, no KV).
    `chunking`: admitted requests with prompt tokens left (mid-chunk), in admission order; their
    next chunks are planned before any new admission, so they keep priority.
    """

    def __init__(self) -> None:
        self.pending_list: deque[Request] = deque()
        self.chunking: list[Request] = []


class DecodeManager:
    """`running_reqs`: admitted requests with the whole prompt prefilled, in admission order.

    The decode batch view (slots as a numpy array, ids, sampling params) is cached and rebuilt only
    when membership changes, so a steady decode step does no per-request Python work to plan.
    """

    def __init__(self) -> None:
        self.running_reqs: dict[str, Request] = {}
        self._slots: np.ndarray | None = None
        self._rids: list[str] = []
        self._sampling: list[SamplingParams] = []

    def __len__(self) -> int:
        return len(self.running_reqs)

    def add(self, request: Request) -> None:
        self.running_reqs[request.rid] = request
        self._slots = None

    def remove(self, rid: str) -> None:
        del self.running_reqs[rid]
        self._slots = None

    def batch_view(self) -> tuple[np.ndarray, list[str], list[SamplingParams]]:
        """(slots, rids, sampling params) of every running request, in admission order.

        The lists are replaced, never mutated, on membership change: callers may keep them.
        """
        if self._slots is None:
            reqs = self.running_reqs.values()
            self._slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=len(self.running_reqs))
            self._rids = [r.rid for r in reqs]
            self._sampling = [r.sampling for r in reqs]
        return self._slots, self._rids, self._sampling
