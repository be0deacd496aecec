"""Benchmark results as text tables and JSON: absolute numbers, then ratios to a baseline."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchserve.loadtests.metrics import BenchMetrics
from batchserve.loadtests.runner import LoadPoint
from batchserve.loadtests.server_stats import ServerStats


@dataclass(frozen=True)
class RunRecord:
    config: str  # "mixed", "prefill-first", "fixed", "transformers", a URL's label, or "server"
    point: LoadPoint
    metrics: BenchMetrics
    server: ServerStats | None = None  # sampled from a batchserve /metrics during the run
    by_turn: dict[int, BenchMetrics] | None = None  # multi-turn chats: the requests of each turn (0-based)

    def preemptions_per_100(self) -> float | None:
        if self.server is None or not self.metrics.completed + self.metrics.failed:
            return None
        return 100.0 * self.server.preemptions / (self.metrics.completed + self.metrics.failed)

    def to_dict(self) -> dict[str, Any]:
        rate = self.point.request_rate
        return {
            "config": self.config,
            "concurrency": self.point.concurrency,
            "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
            "metrics": self.metrics.to_dict(),
            "server": None if self.server is None else self.server.to_dict(),
            "by_turn": None if self.by_turn is None else {t: m.to_dict() for t, m in self.by_turn.items()},
        }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_run(record: RunRecord) -> str:
    m = record.metrics
    lines = [
        f"============ {record.config} @ {record.point.label()} ============",
        f"{'Successful requests:':<34}{m.completed}",
        f"{'Failed requests:':<34}{m.failed}",
        f"{'Benchmark duration (s):':<34}{m.duration_s:.2f}",
        f"{'Total input tokens:':<34}{m.total_input_tokens}",
        f"{'Total generated tokens:':<34}{m.total_output_tokens}",
        f"{'Cached input tokens (server):':<34}{m.total_cached_tokens} ({_percent(m.cache_hit_rate)} hit rate)",
        f"{'Request throughput (req/s):':<34}{m.request_throughput:.2f}",
        f"{'Input token throughput (tok/s):':<34}{m.input_throughput:.2f}",
        f"{'Output token throughput (tok/s):':<34}{m.output_throughput:.2f}",
    ]
    if m.slo is not None:
        lines.append(f"{'Good requests (' + m.slo.label() + '):':<34}{m.good_requests} ({_percent(m.good_fraction)})")
        lines.append(f"{'Request goodput (req/s):':<34}{m.goodput:.2f}")
    for name, dist in (("TTFT", m.ttft_ms), ("ITL", m.itl_ms), ("TPOT", m.tpot_ms), ("E2E latency", m.e2e_ms)):
        lines.append(
            f"{name + ' (ms)':<14} mean {_ms(dist.mean):>9}  p50 {_ms(dist.p50):>9}  "
            f"p90 {_ms(dist.p90):>9}  p99 {_ms(dist.p99):>9}"
        )
    if record.server is not None and record.server.itl_token_ms(0.5) is not None:
        token = [record.server.itl_token_ms(q) for q in (0.5, 0.9, 0.99)]
        lines.append(
            f"{'ITL per token (server, ms)':<26} p50 {_ms(token[0]):>9}  p90 {_ms(token[1]):>9}  p99 {_ms(token[2]):>9}"
        )
    if record.server is not None:
        lines.append(f"{'Peak running requests:':<34}{record.server.peak_running}")
        lines.append(
            f"{'Preemptions (per 100 requests):':<34}{record.server.preemptions} ({record.preemptions_per_100():.1f})"
        )
        if record.server.mean_rows is not None:
            lines.append(f"{'Steps (requests per step):':<34}{record.server.steps} ({record.server.mean_rows:.1f})")
    return "\n".join(lines)


TABLE_HEADER = (
    f"{'load':<16}{'config':<16}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>11}"
    f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}"
)


SERVER_HEADER = f"{'peak run':>9}{'preempt/100':>12}{'tok ITL p99':>12}"  # per token, as the api delivered them
GOODPUT_HEADER = f"{'good %':>8}{'goodput':>9}"


def _percent(fraction: float | None, unit: str = " %") -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}{unit}"


def format_table(records: Sequence[RunRecord]) -> str:
    """All runs, grouped by load point; latencies in ms. Server-side columns when any run has them."""
    with_server = any(r.server is not None for r in records)
    with_goodput = any(r.metrics.slo is not None for r in records)
    header = TABLE_HEADER + (GOODPUT_HEADER if with_goodput else "") + (SERVER_HEADER if with_server else "")
    rows = [header, "-" * len(header)]
    for r in records:
        m = r.metrics
        row = (
            f"{r.point.label():<16}{r.config:<16}{m.completed:>5}{m.failed:>5}{m.request_throughput:>8.2f}"
            f"{m.output_throughput:>11.1f}{_ms(m.ttft_ms.p50):>10}{_ms(m.ttft_ms.p99):>10}"
            f"{_ms(m.itl_ms.p50):>9}{_ms(m.itl_ms.p99):>9}{_ms(m.tpot_ms.p50):>10}"
        )
        if with_goodput:
            row += f"{_percent(m.good_fraction, ''):>8}{'-' if m.goodput is None else f'{m.goodput:.2f}':>9}"
        if with_server:
            per_100 = r.preemptions_per_100()
            token_p99 = None if r.server is None else r.server.itl_token_ms(0.99)
            row += (
                f"{'-' if r.server is None else r.server.peak_running:>9}"
                f"{'-' if per_100 is None else f'{per_100:.1f}':>12}{_ms(token_p99):>12}"
            )
        rows.append(row)
    return "\n".join(rows)


def format_turns(records: Sequence[RunRecord]) -> str:
    """TTFT of each turn of multi-turn chats, per config (ms), and the prefix-cache hit rate of all of
    them; "" when no record has turns."""
    with_turns = [r for r in records if r.by_turn]
    if not with_turns:
        return ""
    turns = sorted({t for r in with_turns for t in r.by_turn})  # type: ignore[union-attr]
    header = (
        f"{'load':<16}{'config':<16}" + "".join(f"{f'turn {t + 1} p50/p99':>22}" for t in turns) + f"{'cache hits':>12}"
    )
    rows = ["TTFT by turn (ms), prefix-cache hit rate", header, "-" * len(header)]
    for r in with_turns:
        cells = "".join(
            f"{_ms(r.by_turn[t].ttft_ms.p50) + ' / ' + _ms(r.by_turn[t].ttft_ms.p99):>22}"  # type: ignore[index]
            if t in r.by_turn
            else f"{'-':>22}"
            for t in turns
        )  # type: ignore[operator]
        rows.append(f"{r.point.label():<16}{r.config:<16}{cells}{_percent(r.metrics.cache_hit_rate):>12}")
    return "\n".join(rows)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def ratio_rows(records: Sequence[RunRecord], baseline: str) -> list[dict[str, Any]]:
    """Per load point and config, each metric divided by the baseline config's at the same point.

    Throughput ratio > 1 is better; latency ratios < 1 are better.
    """
    base_by_point = {r.point: r.metrics for r in records if r.config == baseline}
    rows = []
    for r in records:
        base = base_by_point.get(r.point)
        if base is None or r.config == baseline:
            continue
        m = r.metrics
        rows.append(
            {
                "config": r.config,
                "point": r.point.label(),
                "baseline": baseline,
                "output_throughput": _ratio(m.output_throughput, base.output_throughput),
                "goodput": _ratio(m.goodput, base.goodput),
                "ttft_p50": _ratio(m.ttft_ms.p50, base.ttft_ms.p50),
                "ttft_p99": _ratio(m.ttft_ms.p99, base.ttft_ms.p99),
                "itl_p50": _ratio(m.itl_ms.p50, base.itl_ms.p50),
                "itl_p99": _ratio(m.itl_ms.p99, base.itl_ms.p99),
            }
        )
    return rows


def format_ratios(records: Sequence[RunRecord], baseline: str) -> str:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    with_goodput = any(r.metrics.slo is not None for r in records)
    header = (
        f"{'load':<16}{'config':<16}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}" + (f"{'goodput':>9}" if with_goodput else "")
    )
    rows = [
        f"ratios vs {baseline} (throughput: higher is better; latencies: lower is better)",
        header,
        "-" * len(header),
    ]
    for row in ratio_rows(records, baseline):
        rows.append(
            f"{row['point']:<16}{row['config']:<16}{x(row['output_throughput']):>10}{x(row['ttft_p50']):>10}"
            f"{x(row['ttft_p99']):>10}{x(row['itl_p50']):>9}{x(row['itl_p99']):>9}"
            + (f"{x(row['goodput']):>9}" if with_goodput else "")
        )
    return "\n".join(rows)


def write_json(
    path: Path,
    workload: dict[str, Any],
    records: Sequence[RunRecord],
    baselines: Sequence[str],
    errors: Sequence[str] = (),
) -> None:
    doc = {
        "workload": workload,
        "runs": [r.to_dict() for r in records],
        "ratios": {b: ratio_rows(records, b) for b in baselines},
        "errors": list(errors),
    }
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
