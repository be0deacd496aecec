"""What a benchmark reads from a batchserve server's `/metrics` while it measures: how many requests
ran at once at the peak, and how many were preempted (procs/scheduler/SCHEDULING.md's estimated reservation)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "batchserve_num_requests_running"
PREEMPTIONS = "batchserve_preemptions_total"


@dataclass(frozen=True)
class ServerStats:
    peak_running: int
    preemptions: int

    def merged(self, other: "ServerStats | None") -> "ServerStats":
        """Pooled over rounds: the higher peak, the preemptions added up."""
        if other is None:
            return self
        return ServerStats(max(self.peak_running, other.peak_running), self.preemptions + other.preemptions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ServerStatsProbe:
    """Samples `metrics_url` every `interval_s` from enter to exit. `stats` stays None for a server
    without batchserve's metrics (another engine, or one that does not answer)."""

    def __init__(self, session: aiohttp.ClientSession, metrics_url: str, interval_s: float = 0.1) -> None:
        self.session, self.url, self.interval_s = session, metrics_url, interval_s
        self.stats: ServerStats | None = None
        self._peak = 0.0
        self._task: asyncio.Task[None] | None = None
        self._first: dict[str, float] | None = None

    async def _read(self) -> dict[str, float] | None:
        try:
            async with self.session.get(self.url) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name in (RUNNING, PREEMPTIONS)}
        return values if len(values) == 2 else None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            values = await self._read()
            if values is not None:
                self._peak = max(self._peak, values[RUNNING])

    async def __aenter__(self) -> "ServerStatsProbe":
        self._first = await self._read()
        if self._first is not None:
            self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is None or self._first is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        last = await self._read()
        if last is not None:
            self.stats = ServerStats(int(self._peak), int(last[PREEMPTIONS] - self._first[PREEMPTIONS]))
