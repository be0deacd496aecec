"""Metric arithmetic of `batchserve bench` on synthetic timestamps."""

from __future__ import annotations

import numpy as np
import pytest

from batchserve.loadtests.client import RequestResult
from batchserve.loadtests.metrics import Distribution, e2e_latency, inter_token_latencies, summarize, tpot, ttft


def result(
    send: float, chunks: list[float], end: float, prompt: int = 10, output: int | None = None, success: bool = True
) -> RequestResult:
    return RequestResult(
        success=success,
        send_time=send,
        chunk_times=chunks,
        end_time=end,
        prompt_tokens=prompt,
        output_tokens=len(chunks) if output is None else output,
        usage_reported=True,
    )


def test_per_request_definitions():
    r = result(send=1.0, chunks=[1.5, 1.6, 1.8, 2.1], end=2.2)
    assert ttft(r) == pytest.approx(0.5)  # first content chunk - send
    assert inter_token_latencies(r) == pytest.approx([0.1, 0.2, 0.3])  # gaps between content chunks
    assert e2e_latency(r) == pytest.approx(1.2)
    assert tpot(r) == pytest.approx((1.2 - 0.5) / 3)  # (e2e - ttft) / (output_tokens - 1)


def test_tpot_uses_usage_token_count_not_chunk_count():
    # a detokenizer may hold text back: 2 chunks carrying 5 tokens
    r = result(send=0.0, chunks=[0.2, 1.0], end=1.0, output=5)
    assert tpot(r) == pytest.approx(0.8 / 4)
    assert tpot(result(send=0.0, chunks=[0.3], end=0.3, output=1)) is None


def test_summary_excludes_failed_requests():
    ok = [result(0.0, [0.1, 0.2, 0.4], 0.4, prompt=7), result(0.5, [0.7, 0.8, 0.9], 1.0, prompt=9)]
    failed = result(0.2, [0.3], 5.0, prompt=1000, output=1000, success=False)
    m = summarize([*ok, failed], duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 16 and m.total_output_tokens == 6
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(8.0) and m.output_throughput == pytest.approx(3.0)
    assert m.ttft_ms.count == 2 and m.ttft_ms.mean == pytest.approx(150.0)
    assert m.itl_ms.count == 4  # pooled gaps: 0.1, 0.2 and 0.1, 0.1
    assert m.itl_ms.mean == pytest.approx(125.0)
    assert m.e2e_ms.p50 == pytest.approx(450.0)  # latencies 0.4 and 0.5; the failed 4.8 s is not there


def test_percentiles_match_numpy_linear_interpolation():
    samples = [0.001 * i for i in range(1, 101)]  # 1..100 ms
    d = Distribution.of_seconds(samples)
    assert d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert d.mean == pytest.approx(50.5)
    rng = np.random.default_rng(0)
    xs = rng.exponential(0.05, size=37)
    d = Distribution.of_seconds(xs.tolist())
    assert d.p99 == pytest.approx(float(np.percentile(xs * 1000, 99)))


def test_empty_and_all_failed_runs_report_no_latencies():
    m = summarize([result(0.0, [0.1], 0.1, success=False)], duration_s=1.0)
    assert m.completed == 0 and m.failed == 1 and m.output_throughput == 0
    assert m.ttft_ms == Distribution(0, None, None, None, None)
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0)


def test_goodput_counts_requests_meeting_every_objective():
    from batchserve.loadtests.metrics import Slo

    slo = Slo.parse(["ttft:200", "tpot:100"])
    fast = result(0.0, [0.1, 0.15, 0.2], 0.2)  # TTFT 100 ms, TPOT 50 ms: good
    slow_start = result(0.0, [0.5, 0.55], 0.55)  # TTFT 500 ms
    slow_stream = result(0.0, [0.1, 0.4, 0.7], 0.7)  # TPOT 300 ms
    one_token = result(0.0, [0.15], 0.15)  # no TPOT: meets it
    failed = result(0.0, [0.05], 0.06, success=False)
    m = summarize([fast, slow_start, slow_stream, one_token, failed], duration_s=2.0, slo=slo)
    assert m.good_requests == 2
    assert m.goodput == pytest.approx(1.0)
    assert m.good_fraction == pytest.approx(2 / 5)  # failed requests count as sent, never as good
    assert summarize([fast], duration_s=1.0).goodput is None  # no objectives: no goodput


def test_goodput_objectives_parse_as_vllm_spells_them():
    from batchserve.shared.slo import DEFAULT_SLOS, Slo

    assert Slo.parse(["ttft:2000", "tpot:100", "e2el:9000"]) == Slo(2000.0, 100.0, 9000.0)
    assert Slo.parse(["cpu"]) == DEFAULT_SLOS["cpu"]
    assert Slo.parse(["tpot:50"]).label() == "tpot:50"
    for bad in (["ttft"], ["itl:5"], ["ttft:1", "ttft:2"], ["ttft:fast"], ["ttft:0"], ["ttft:nan"], ["tpot:inf"], []):
        with pytest.raises(ValueError, match="objective"):
            Slo.parse(bad)
