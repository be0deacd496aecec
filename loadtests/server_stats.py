"""What a benchmark reads from a batchserve server's `/metrics` while it measures: how many requests
ran at once at the peak, how many were preempted (procs/scheduler/SCHEDULING.md's estimated reservation),
and the gaps between successive tokens as the api delivered them (its inter-token latency histogram).

The last differs from the client's ITL, which is measured per chunk of text (as clients see it, and as
`loadtests.metrics` counts it): a token whose text the detokenizer holds back (part of a UTF-8 character,
a possible stop string) sends no chunk, so the client sees one gap of two steps where the server ran two
steps of one. On prompts of random token ids 3.6 % of the tokens were held so; then the client's p99 is
the hold-back's, and the per-token gaps are what a step-time bound (`--max-step-ms`) bounds. Read it for
what it is: one observation per delivery (a speculative step's several tokens are one), over the run with
its warm-up requests, and its quantiles interpolated within a histogram bucket (p99 292 ms: somewhere in
(250, 300] ms)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from batchserve.procs.api.live_view import quantile

RUNNING = "batchserve_num_requests_running"
PREEMPTIONS = "batchserve_preemptions_total"
STEPS = "batchserve_batch_size_count"  # one observation per model step
STEP_ROWS = "batchserve_batch_size_sum"  # the requests those steps carried
ITL_BUCKETS = "batchserve_inter_token_latency_seconds_bucket"

Buckets = tuple[tuple[float, float], ...]  # a histogram's (upper bound, cumulative count)


@dataclass(frozen=True)
class ServerStats:
    peak_running: int
    preemptions: int
    itl_buckets: Buckets = ()  # the api's inter-token latency histogram over the run (per token delivered)
    steps: int = 0  # model steps over the run
    step_rows: int = 0  # the requests those steps carried (a decode row, a prefill chunk: one each)

    @property
    def mean_rows(self) -> float | None:
        """Requests per step: how full the steps ran (a step reads every weight whatever its rows)."""
        return self.step_rows / self.steps if self.steps else None

    def merged(self, other: ServerStats | None) -> ServerStats:
        """Pooled over rounds: the higher peak, the preemptions and the histograms added up."""
        if other is None:
            return self
        buckets = tuple((le, a + b) for (le, a), (_, b) in zip(self.itl_buckets, other.itl_buckets))
        return ServerStats(
            max(self.peak_running, other.peak_running),
            self.preemptions + other.preemptions,
            buckets or self.itl_buckets or other.itl_buckets,
            self.steps + other.steps,
            self.step_rows + other.step_rows,
        )

    def itl_token_ms(self, q: float) -> float | None:
        """The q-quantile of the per-token gaps, ms (Prometheus' `histogram_quantile`); None without any."""
        if not self.itl_buckets or self.itl_buckets[-1][1] <= 0:
            return None
        return 1e3 * quantile(q, [(le, 0.0) for le, _ in self.itl_buckets], list(self.itl_buckets))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["itl_buckets"]
        out["mean_rows"] = self.mean_rows
        out["itl_token_ms"] = {f"p{round(q * 100)}": self.itl_token_ms(q) for q in (0.5, 0.9, 0.99)}
        return out


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
        except (TimeoutError, aiohttp.ClientError):
            return None
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        values = {s.name: s.value for s in samples if s.name in (RUNNING, PREEMPTIONS, STEPS, STEP_ROWS)}
        values.update({f"le={s.labels['le']}": s.value for s in samples if s.name == ITL_BUCKETS})
        return values if RUNNING in values and PREEMPTIONS in values else None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            values = await self._read()
            if values is not None:
                self._peak = max(self._peak, values[RUNNING])

    async def __aenter__(self) -> ServerStatsProbe:
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
            first = self._first
            itl = tuple(
                sorted((float(key[3:]), last[key] - first.get(key, 0.0)) for key in last if key.startswith("le="))
            )
            counted = {key: int(last.get(key, 0.0) - first.get(key, 0.0)) for key in (PREEMPTIONS, STEPS, STEP_ROWS)}
            self.stats = ServerStats(int(self._peak), counted[PREEMPTIONS], itl, counted[STEPS], counted[STEP_ROWS])
