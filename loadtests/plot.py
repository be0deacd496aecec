"""One PNG: throughput and p50/p99 TTFT and ITL against the sweep axis, one line per configuration."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from batchserve.loadtests.metrics import BenchMetrics
from batchserve.loadtests.report import RunRecord

PANELS: tuple[tuple[str, Callable[[BenchMetrics], float | None]], ...] = (
    ("output tokens/s", lambda m: m.output_throughput),
    ("TTFT p50 (ms)", lambda m: m.ttft_ms.p50),
    ("TTFT p99 (ms)", lambda m: m.ttft_ms.p99),
    ("requests/s", lambda m: m.request_throughput),
    ("ITL p50 (ms)", lambda m: m.itl_ms.p50),
    ("ITL p99 (ms)", lambda m: m.itl_ms.p99),
)


def plot_sweep(records: Sequence[RunRecord], path: Path, title: str = "") -> None:
    if not records:
        raise ValueError("nothing to plot: no benchmark runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = records[0].point.axis
    configs = list(dict.fromkeys(r.config for r in records))
    finite_rates = [r.point.value for r in records if not math.isinf(r.point.value)]
    inf_at = (max(finite_rates) * 2) if finite_rates else 1.0  # where an infinite request rate is drawn
    has_inf = any(math.isinf(r.point.value) for r in records)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, metric) in zip(axes.flat, PANELS):
        for config in configs:
            points = sorted(
                (inf_at if math.isinf(r.point.value) else r.point.value, metric(r.metrics))
                for r in records
                if r.config == config
            )
            xs = [x for x, y in points if y is not None]
            ys = [y for x, y in points if y is not None]
            ax.plot(xs, ys, marker="o", label=config)
        ys_all = [y for r in records if (y := metric(r.metrics)) is not None and y > 0]
        if "ms" in name and ys_all and max(ys_all) / min(ys_all) > 20:  # a slow baseline would flatten the rest
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("concurrency" if axis == "concurrency" else "request rate (req/s)")
        xs_all = sorted({inf_at if math.isinf(r.point.value) else r.point.value for r in records})
        if len(xs_all) > 2:
            ax.set_xscale("log", base=2)
        # inf_at lies above every finite value, so it labels only the infinite request rate
        ax.set_xticks(xs_all, ["inf" if x == inf_at and has_inf else f"{x:g}" for x in xs_all])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
