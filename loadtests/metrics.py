"""Metric arithmetic, with the definitions of vLLM's and SGLang's serving benchmarks.

- TTFT: first token chunk (`sse.carries_token`: text, or a token whose text is still empty) - send time.
- ITL: every gap between successive token chunks, pooled over all requests.
- TPOT: per request, (e2e - TTFT) / (output_tokens - 1); requests with one output token have none.
- E2E latency: end of stream - send time.
- Throughputs divide totals over successful requests by the benchmark duration.
- Goodput (vLLM's `--goodput`, DistServe's): requests per second that completed and met every
  objective of an `Slo` (TTFT, TPOT, E2E latency); a one-token request has no TPOT and meets its
  objective, as in vLLM.
Failed requests count only in `failed`; they contribute no latencies and no tokens, and are not good.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from batchserve.loadtests.client import RequestResult
from batchserve.shared.slo import Slo

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles in milliseconds; None when there were no samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, samples: Sequence[float]) -> Distribution:
        if len(samples) == 0:
            return cls(0, None, None, None, None)
        ms = np.asarray(samples, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(len(ms), float(ms.mean()), p50, p90, p99)


def met_slo(slo: Slo, result: RequestResult) -> bool:
    """The request completed and met every objective of `slo`."""
    return result.success and all(slo.met(ttft(result), tpot(result), e2e_latency(result)).values())


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    input_throughput: float  # tokens/s
    output_throughput: float  # tokens/s
    ttft_ms: Distribution
    itl_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution
    total_cached_tokens: int = 0  # of the input tokens, those the server reported as found in its prefix cache
    slo: Slo | None = None  # the goodput objectives, when measured
    good_requests: int = 0  # requests that met every objective of `slo`
    goodput: float | None = None  # good requests/s

    @property
    def good_fraction(self) -> float | None:
        """Of every request sent (failed ones included), the share that met the objectives."""
        sent = self.completed + self.failed
        return None if self.slo is None or not sent else self.good_requests / sent

    @property
    def cache_hit_rate(self) -> float | None:
        """The prefix-cache hit rate the server reported: cached input tokens / input tokens."""
        return self.total_cached_tokens / self.total_input_tokens if self.total_input_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cache_hit_rate": self.cache_hit_rate}


def ttft(result: RequestResult) -> float:
    return result.chunk_times[0] - result.send_time


def inter_token_latencies(result: RequestResult) -> list[float]:
    times = result.chunk_times
    return [b - a for a, b in zip(times, times[1:])]


def tpot(result: RequestResult) -> float | None:
    if result.output_tokens <= 1:
        return None
    return (e2e_latency(result) - ttft(result)) / (result.output_tokens - 1)


def e2e_latency(result: RequestResult) -> float:
    return result.end_time - result.send_time


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo | None = None) -> BenchMetrics:
    """Aggregate one benchmark run; `duration_s` is wall time from first send to last completion;
    goodput against `slo` when given."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    ttfts = [ttft(r) for r in ok]
    itls = [gap for r in ok for gap in inter_token_latencies(r)]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    e2es = [e2e_latency(r) for r in ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = sum(met_slo(slo, r) for r in ok) if slo is not None else 0
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) / duration_s,
        input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s,
        ttft_ms=Distribution.of_seconds(ttfts),
        itl_ms=Distribution.of_seconds(itls),
        tpot_ms=Distribution.of_seconds(tpots),
        e2e_ms=Distribution.of_seconds(e2es),
        slo=slo,
        good_requests=good,
        goodput=None if slo is None else good / duration_s,
    )
