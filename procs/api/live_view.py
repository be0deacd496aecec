"""The live view's data (`GET /dashboard/snapshot`, which `/dashboard` polls): the scheduler's latest
view (`shared.scheduler_view`, pushed inside `SchedulerStats`), its recent steps, and a history of the
last minutes sampled about once a second from the api's own metrics (output tokens/s, TTFT and
inter-token latency percentiles over a sliding window, as Prometheus' `histogram_quantile` reads the
same histograms, queue and running-set sizes, KV use); tokens/s counts tokens as they are streamed.

What the view costs is in `/metrics`: `batchserve_live_view_request_seconds` (answering a snapshot, here)
and `batchserve_scheduler_view_build_seconds` (building the views, in the scheduler)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import Counter, Histogram

from batchserve.procs.api.metrics import ApiMetrics
from batchserve.shared.messages import SchedulerStats
from batchserve.shared.scheduler_view import SchedulerView, StepView

HISTORY_S = 300  # the plots' span: five minutes at one sample a second
SAMPLE_EVERY_S = 1.0
PERCENTILE_WINDOW_S = 10.0  # latency percentiles of each sample: over the tokens of the last ten seconds
STEPS_SHOWN = 240  # the step plot's span, in steps
# The snapshot's totals: its name -> the /metrics counter it reads (`batchserve_<counter>_total`)
TOTALS = {
    "preemptions": "preemptions",
    "steps_target_out_of_reach": "step_target_out_of_reach",
    "spec_drafts": "spec_decode_num_drafts",
    "spec_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens",
}


class HistorySample(msgspec.Struct, array_like=True):
    """One point of the plots: seconds since the api started, output tokens/s since the previous sample,
    TTFT p50 / p90 and inter-token latency p50 / p99 in ms (-1: no token in the window), waiting and
    running requests, KV pages used / total."""

    t: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    waiting: int
    running: int
    kv_used_ratio: float


Buckets = list[tuple[float, float]]  # (upper bound, cumulative count) of each bucket of a histogram


def histogram_counts(histogram: Histogram) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of each bucket of an unlabelled histogram, +Inf last."""
    metric = next(iter(histogram.collect()))
    return [(float(s.labels["le"]), s.value) for s in metric.samples if s.name.endswith("_bucket")]


def quantile(q: float, before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    """Prometheus' `histogram_quantile(q, increase(...))` between two readings of one histogram: linear
    within the bucket that holds the rank; -1 with no observation between them."""
    counts = [(le, b - a) for (le, b), (_, a) in zip(after, before)]
    total = counts[-1][1]
    if total <= 0:
        return -1.0
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in counts:
        if count >= rank:
            if le == float("inf"):
                return lower  # past the last finite bound: that bound, as Prometheus answers
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


def quantile_ms(q: float, before: Buckets, after: Buckets) -> float:
    """`quantile` of a histogram of seconds, in ms rounded to 0.1."""
    return round(quantile(q, before, after) * 1e3, 1)


class LiveView:
    """The scheduler's latest view and recent steps, and the plots' history (see the module doc)."""

    def __init__(self, metrics: ApiMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.started = clock()
        self.latest: SchedulerView | None = None
        self.steps: deque[StepView] = deque(maxlen=STEPS_SHOWN)
        self.history: deque[HistorySample] = deque(maxlen=int(HISTORY_S / SAMPLE_EVERY_S))
        # (time, generated tokens, TTFT buckets, ITL buckets) of past samples, for the windows' differences
        self._readings: deque[tuple[float, float, Buckets, Buckets]] = deque()
        registry = metrics.registry
        self.request_seconds = Histogram(
            "batchserve_live_view_request_seconds",
            "Time the api spent answering a live-view snapshot (/dashboard/snapshot)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=registry,
        )
        self.build_seconds = Counter(
            "batchserve_scheduler_view_build_seconds",
            "Time the scheduler spent building its live views",
            registry=registry,
        )

    def observe(self, stats: SchedulerStats) -> None:
        """Take a stats message's view; sample the history when a second has passed."""
        if stats.view is not None:
            self.latest = stats.view
            self.steps.extend(stats.view.steps)
            self.build_seconds.inc(stats.view.build_ms / 1e3)
        now = self.clock()
        if not self._readings or now - self._readings[-1][0] >= SAMPLE_EVERY_S:
            self._sample(now, stats)

    def _sample(self, now: float, stats: SchedulerStats) -> None:
        m = self.metrics
        reading = (now, m.tokens_delivered, histogram_counts(m.ttft), histogram_counts(m.itl))
        self._readings.append(reading)
        while now - self._readings[0][0] > PERCENTILE_WINDOW_S + SAMPLE_EVERY_S:
            self._readings.popleft()
        if len(self._readings) < 2:
            return
        previous, oldest = self._readings[-2], self._readings[0]
        kv_total = stats.kv_total_tokens
        ttft, itl = (oldest[2], reading[2]), (oldest[3], reading[3])
        self.history.append(
            HistorySample(
                round(now - self.started, 2),
                round((reading[1] - previous[1]) / max(now - previous[0], 1e-6), 1),
                quantile_ms(0.5, *ttft),
                quantile_ms(0.9, *ttft),
                quantile_ms(0.5, *itl),
                quantile_ms(0.99, *itl),
                stats.num_waiting,
                stats.num_running,
                round(stats.kv_used_tokens / kv_total, 4) if kv_total else 0.0,
            )
        )

    def totals(self) -> dict[str, float]:
        """Since the api started, from /metrics' own counters: preemptions, steps whose decodes alone took the
        step-time target, speculative drafts, their tokens and the accepted ones."""
        read = self.metrics.registry.get_sample_value
        return {name: read(f"batchserve_{metric}_total") or 0 for name, metric in TOTALS.items()}

    def snapshot(self) -> dict[str, Any]:
        return {
            "uptime_s": round(self.clock() - self.started, 2),
            "scheduler": self.latest,
            "totals": self.totals(),
            "steps": list(self.steps),
            "history": list(self.history),
        }

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = msgspec.json.encode(self.snapshot())
        self.request_seconds.observe(time.perf_counter() - started)
        return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})
