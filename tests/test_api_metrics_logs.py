"""/metrics after real requests and pushed scheduler stats; the request log line in text and JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine
from prometheus_client.parser import text_string_to_metric_families

from batchserve.procs.api.app import create_app
from batchserve.procs.api.metrics import PROTOCOL_ALIASES
from batchserve.shared.config import ServerConfig
from batchserve.shared.logs import JsonFormatter, TextFormatter, log_event, setup_logging
from batchserve.shared.messages import SchedulerStats


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(page: dict, name: str, **labels) -> float:
    return page[(name, tuple(sorted(labels.items())))]


def test_gauges_routers_read_with_their_protocol_names_and_the_queue_time():
    """The Inference Extension's gauges (waiting, running, KV utilization as a fraction), ours and their
    vLLM-named aliases alike, and the queue-time histogram from the scheduler's stats."""

    async def go():
        engine = FakeEngine()
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            before = samples(await (await client.get("/metrics")).text())
            engine.push_stats(
                SchedulerStats(
                    num_running=3,
                    num_waiting=5,
                    kv_used_tokens=1024,
                    kv_total_tokens=4096,
                    kv_request_pages_max=17,
                    queue_times=[0.5, 2.0],
                )
            )
            after = samples(await (await client.get("/metrics")).text())
        return before, after

    before, after = run(go())
    assert value(after, "batchserve_kv_request_pages_max") == 17
    assert value(before, "batchserve_request_queue_time_seconds_count") == 0
    assert value(after, "batchserve_request_queue_time_seconds_count") == 2
    assert value(after, "batchserve_request_queue_time_seconds_sum") == 2.5
    assert value(after, "batchserve_kv_cache_usage_ratio") == 0.25
    for ours, alias in PROTOCOL_ALIASES.items():
        assert value(before, alias) == value(before, ours) == 0, alias
        assert value(after, alias) == value(after, ours), alias
    assert [value(after, n) for n in PROTOCOL_ALIASES.values()] == [5, 3, 0.25]


def test_expert_load_as_an_imbalance_histogram_not_a_series_per_expert():
    """Tokens routed per MoE layer and expert become one histogram (busiest / mean, per layer and interval)
    and one gauge (the worst layer), whatever the number of layers and experts."""

    async def go():
        engine = FakeEngine()
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            load = np.array([[4, 4, 4, 4], [10, 2, 2, 2], [0, 0, 0, 0]])  # balanced, skewed, an idle layer
            engine.push_stats(
                SchedulerStats(num_running=1, num_waiting=0, kv_used_tokens=0, kv_total_tokens=16, expert_load=load)
            )
            return await (await client.get("/metrics")).text()

    text = run(go())
    page = samples(text)
    assert value(page, "batchserve_moe_expert_load_imbalance_count") == 2  # the idle layer is not observed
    assert value(page, "batchserve_moe_expert_load_imbalance_sum") == pytest.approx(1.0 + 2.5)
    assert value(page, "batchserve_moe_max_expert_load_imbalance") == 2.5
    assert value(page, "batchserve_moe_routed_tokens_total") == 32
    assert not [line for line in text.splitlines() if "moe" in line and "expert=" in line]


class CaptureRequestLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self):
        logger = logging.getLogger("batchserve.requests")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("batchserve.requests")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def test_metrics_move_after_requests_and_stats():
    async def go():
        engine = FakeEngine(delay=0.002)
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            resp = await client.get("/metrics")
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            before = samples(await resp.text())
            for path, body in [
                ("/v1/completions", {"prompt": "a b c", "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}),
                ("/v1/completions", {"prompt": "x", "top_k": 0}),
            ]:  # the last one: a 400
                await (await client.post(path, json=body)).read()
            engine.push_stats(
                SchedulerStats(
                    num_running=3,
                    num_waiting=5,
                    kv_used_tokens=640,
                    kv_total_tokens=4096,
                    batch_sizes=[1, 3, 3],
                    preemptions=2,
                    kv_reserve_ratio=0.05,
                    steps_target_out_of_reach=4,
                    spec_drafts=3,
                    spec_draft_tokens=12,
                    spec_accepted_tokens=7,
                )
            )
            engine.push_stats(
                SchedulerStats(
                    num_running=3,
                    num_waiting=5,
                    kv_used_tokens=640,
                    kv_total_tokens=4096,
                    preemptions=1,
                    kv_reserve_ratio=0.05,
                )
            )
            after = samples(await (await client.get("/metrics")).text())
        return before, after

    before, after = run(go())
    for name in (
        "batchserve_num_requests_running",
        "batchserve_num_requests_waiting",
        "batchserve_kv_cache_used_tokens",
        "batchserve_kv_cache_total_tokens",
        "batchserve_api_requests_in_flight",
        "batchserve_prompt_tokens_total",
        "batchserve_generation_tokens_total",
        "batchserve_time_to_first_token_seconds_count",
        "batchserve_inter_token_latency_seconds_count",
        "batchserve_e2e_request_latency_seconds_count",
        "batchserve_batch_size_count",
        "batchserve_preemptions_total",
        "batchserve_step_target_out_of_reach_total",
        "batchserve_spec_decode_num_drafts_total",
        "batchserve_spec_decode_num_draft_tokens_total",
        "batchserve_spec_decode_num_accepted_tokens_total",
    ):
        assert value(before, name) == 0, name
    assert value(after, "batchserve_preemptions_total") == 3  # counts add up across stats messages
    assert value(after, "batchserve_step_target_out_of_reach_total") == 4
    assert [
        value(after, f"batchserve_spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens", "accepted_tokens")
    ] == [3, 12, 7]
    assert value(after, "batchserve_spec_decode_mean_acceptance_length") == pytest.approx(1 + 7 / 3)
    assert value(after, "batchserve_kv_reserve_ratio") == 0.05
    assert value(after, "batchserve_num_requests_running") == 3
    assert value(after, "batchserve_num_requests_waiting") == 5
    assert value(after, "batchserve_kv_cache_used_tokens") == 640
    assert value(after, "batchserve_kv_cache_total_tokens") == 4096
    assert value(after, "batchserve_batch_size_count") == 3 and value(after, "batchserve_batch_size_sum") == 7
    assert value(after, "batchserve_time_to_first_token_seconds_count") == 2
    assert value(after, "batchserve_e2e_request_latency_seconds_count") == 2
    # 4 tokens streamed (3 gaps) + 2 tokens (1 gap)
    assert value(after, "batchserve_inter_token_latency_seconds_count") == 4
    assert value(after, "batchserve_inter_token_latency_seconds_sum") > 0
    assert value(after, "batchserve_prompt_tokens_total") == 3 + 2
    assert value(after, "batchserve_generation_tokens_total") == 4 + 2
    assert value(after, "batchserve_request_success_total", finish_reason="stop") == 1
    assert value(after, "batchserve_request_success_total", finish_reason="length") == 1
    assert value(after, "batchserve_request_rejected_total", status="400") == 1


def test_metrics_count_a_disconnect_as_abort():
    async def go():
        engine = FakeEngine(first_delay=30)
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
            await engine.received.wait()
            task.cancel()
            await asyncio.wait_for(engine.aborted.wait(), 5)
            return samples(await (await client.get("/metrics")).text())

    page = run(go())
    assert value(page, "batchserve_request_success_total", finish_reason="abort") == 1


def _request_log_records(engine: FakeEngine, requests: list[tuple[str, dict]]) -> list[logging.LogRecord]:
    async def go():
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            for path, body in requests:
                await (await client.post(path, json=body)).read()

    with CaptureRequestLog() as capture:
        run(go())
    return capture.records


def test_request_log_one_line_per_request_in_both_formats():
    records = _request_log_records(
        FakeEngine(delay=0.001),
        [
            ("/v1/completions", {"prompt": "a b c", "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            ("/v1/completions", {"prompt": ""}),
        ],
    )
    assert len(records) == 3
    ok, cut, bad = (json.loads(JsonFormatter().format(r)) for r in records)
    assert ok["logger"] == "batchserve.requests" and ok["level"] == "INFO" and ok["message"] == "request"
    assert ok["rid"].startswith("cmpl-") and ok["endpoint"] == "completions" and ok["stream"] is True
    assert (ok["status"], ok["finish_reason"], ok["prompt_tokens"], ok["completion_tokens"]) == (200, "stop", 3, 4)
    assert 0 <= ok["ttft_s"] <= ok["latency_s"]
    assert cut["rid"].startswith("chatcmpl-") and cut["finish_reason"] == "length" and cut["completion_tokens"] == 2
    assert bad["status"] == 400 and bad["finish_reason"] is None and bad["ttft_s"] is None
    assert "prompt must not be empty" in bad["error"]

    text = TextFormatter().format(records[0])
    assert "\n" not in text
    fields = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', text))
    assert fields["rid"] == ok["rid"] and fields["prompt_tokens"] == "3" and fields["completion_tokens"] == "4"
    assert fields["finish_reason"] == "stop" and float(fields["ttft_s"]) >= 0 and float(fields["latency_s"]) > 0
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO batchserve\.requests request rid=", text)
    bad_text = TextFormatter().format(records[2])
    assert 'error="prompt must not be empty"' in bad_text and "ttft_s=null" in bad_text


def test_setup_logging_writes_one_line_per_record_to_stderr(capfd):
    logger = logging.getLogger("batchserve.requests")
    try:
        setup_logging("json")
        setup_logging("json")  # idempotent: still one line per record
        log_event(logger, "request", rid="r1", prompt_tokens=3, note="two words")
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert json.loads(err[0])["rid"] == "r1" and json.loads(err[0])["note"] == "two words"
        setup_logging("text")
        log_event(logger, "request", rid="r2", prompt_tokens=3, note="two words")
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].endswith('request rid=r2 prompt_tokens=3 note="two words"')
    finally:
        root = logging.getLogger()
        for handler in list(root.handlers):
            if type(handler).__name__ == "_BatchserveHandler":
                root.removeHandler(handler)


def test_slo_attainment_counts_the_requests_meeting_each_objective():
    """With --slo the api judges every finished request by its own clock: here each token takes 30 ms
    (TPOT 30 ms) after a first token at about 30 ms, so a 20 ms tpot objective fails and a 10 s ttft
    objective holds; the streamed and the whole answer count alike."""

    async def go():
        engine = FakeEngine(["a", "b", "c", "d"], delay=0.03)
        config = ServerConfig(slo=["ttft:10000", "tpot:20"])
        async with TestClient(TestServer(create_app(engine, config))) as client:
            for stream in (False, True):
                resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": stream})
                await resp.read()
            return samples(await (await client.get("/metrics")).text())

    page = run(go())
    assert value(page, "batchserve_slo_requests_total") == 2
    assert value(page, "batchserve_slo_met_requests_total", objective="ttft") == 2
    assert (
        page.get(("batchserve_slo_met_requests_total", (("objective", "tpot"),)), 0.0),
        page.get(("batchserve_slo_met_requests_total", (("objective", "all"),)), 0.0),
    ) == (0.0, 0.0)
    assert value(page, "batchserve_slo_attainment_ratio", objective="ttft") == 1.0
    assert value(page, "batchserve_slo_attainment_ratio", objective="tpot") == 0.0
    assert value(page, "batchserve_slo_attainment_ratio", objective="all") == 0.0
    with pytest.raises(ValueError, match="objective 'tpot:fast'"):
        ServerConfig(slo=["tpot:fast"])
