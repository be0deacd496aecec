"""Ratio tables, JSON and the plot of `batchserve bench`."""

from __future__ import annotations

import json
import math

import pytest

from batchserve.loadtests.metrics import BenchMetrics, Distribution
from batchserve.loadtests.plot import plot_sweep
from batchserve.loadtests.report import RunRecord, format_ratios, format_table, ratio_rows, write_json
from batchserve.loadtests.runner import LoadPoint


def metrics(out_tps: float, ttft: float, itl: float) -> BenchMetrics:
    def d(v: float) -> Distribution:
        return Distribution(10, v, v, v * 1.5, v * 2)

    return BenchMetrics(10, 0, 1.0, 100, int(out_tps), 10.0, 100.0, out_tps, d(ttft), d(itl), d(itl), d(ttft + itl))


RECORDS = [
    RunRecord("mixed", LoadPoint(request_rate=2.0), metrics(200, 50, 10)),
    RunRecord("fixed", LoadPoint(request_rate=2.0), metrics(100, 100, 5)),
    RunRecord("mixed", LoadPoint(request_rate=math.inf), metrics(400, 80, 20)),
    RunRecord("fixed", LoadPoint(request_rate=math.inf), metrics(100, 400, 10)),
]


def test_ratios_are_per_load_point_against_the_baseline():
    rows = ratio_rows(RECORDS, "fixed")
    assert [(r["config"], r["point"]) for r in rows] == [("mixed", "rate 2/s"), ("mixed", "rate inf/s")]
    assert rows[0]["output_throughput"] == pytest.approx(2.0)
    assert rows[0]["ttft_p50"] == pytest.approx(0.5) and rows[0]["itl_p99"] == pytest.approx(2.0)
    assert rows[1]["output_throughput"] == pytest.approx(4.0) and rows[1]["ttft_p99"] == pytest.approx(0.2)
    text = format_ratios(RECORDS, "fixed")
    assert "4.00x" in text and "0.20x" in text
    assert format_table(RECORDS).count("\n") == 1 + len(RECORDS)


def test_json_is_strict_and_names_infinite_rates(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"workload": "random"}, RECORDS, ["fixed"], errors=["x: failed"])
    doc = json.loads(path.read_text())  # would fail on NaN/Infinity tokens
    assert [r["request_rate"] for r in doc["runs"]] == [2.0, 2.0, "inf", "inf"]
    assert doc["runs"][0]["metrics"]["itl_ms"]["p99"] == 20.0
    assert doc["errors"] == ["x: failed"] and len(doc["ratios"]["fixed"]) == 2


def test_plot_writes_a_png_with_an_infinite_rate(tmp_path):
    path = tmp_path / "plot.png"
    plot_sweep(RECORDS, path, title="t")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        plot_sweep([], path)


def test_goodput_columns_appear_when_objectives_were_measured(tmp_path):
    import dataclasses

    from batchserve.loadtests.metrics import Slo
    from batchserve.loadtests.report import format_run

    slo = Slo(ttft_ms=100.0)
    good = [
        dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, slo=slo, good_requests=n, goodput=n / 1.0))
        for r, n in zip(RECORDS, (8, 4, 6, 2))
    ]
    assert "goodput" not in format_table(RECORDS)
    table = format_table(good)
    assert "good %" in table and "80.0" in table and "8.00" in table
    assert "Request goodput (req/s):" in format_run(good[0]) and "ttft:100" in format_run(good[0])
    rows = ratio_rows(good, "fixed")
    assert rows[0]["goodput"] == pytest.approx(2.0) and rows[1]["goodput"] == pytest.approx(3.0)
    assert "3.00x" in format_ratios(good, "fixed")
    write_json(tmp_path / "run.json", {}, good, ["fixed"])
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["runs"][0]["metrics"]["slo"]["ttft_ms"] == 100.0 and doc["runs"][0]["metrics"]["goodput"] == 8.0


def test_server_itl_quantiles_come_from_the_histogram_and_pool_over_rounds():
    """Per-token gaps as the api's histogram counted them over a run: 90 in (0.2, 0.25], 10 in (0.3, 0.4];
    two rounds pooled bucket by bucket, so their quantiles are the pooled histogram's."""
    from batchserve.loadtests.server_stats import ServerStats

    buckets = ((0.2, 0.0), (0.25, 90.0), (0.3, 90.0), (0.4, 100.0), (float("inf"), 100.0))
    one = ServerStats(4, 0, buckets)
    assert one.itl_token_ms(0.5) == pytest.approx(200 + 50 * 50 / 90)
    assert one.itl_token_ms(0.99) == pytest.approx(300 + 100 * 9 / 10)
    both = one.merged(ServerStats(2, 1, buckets))
    assert (both.peak_running, both.preemptions) == (4, 1) and both.itl_buckets[-1] == (float("inf"), 200.0)
    assert both.itl_token_ms(0.99) == pytest.approx(one.itl_token_ms(0.99))
    assert ServerStats(1, 0).itl_token_ms(0.5) is None and one.merged(ServerStats(1, 0)).itl_buckets == buckets
    assert one.to_dict()["itl_token_ms"]["p99"] == pytest.approx(390.0)
    steps = ServerStats(1, 0, (), 10, 35).merged(ServerStats(1, 0, (), 30, 45))
    assert (steps.steps, steps.mean_rows) == (40, 2.0) and ServerStats(1, 0).mean_rows is None
