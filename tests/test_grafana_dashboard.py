"""The Grafana dashboard shipped beside the systemd units (`systemd/grafana/batchserve-dashboard.json`):
every metric its queries read exists in the api's /metrics, under that exact sample name."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import SchedulerStats

DASHBOARD = Path(__file__).parents[1] / "systemd" / "grafana" / "batchserve-dashboard.json"
METRIC_NAME = re.compile(r"\b(batchserve_[a-z0-9_]+|vllm:[a-z_]+)")


def _exposed_sample_names() -> set[str]:
    """Sample names in /metrics once requests have ended (a labelled counter shows only once counted)."""

    async def go() -> str:
        engine = FakeEngine()
        async with TestClient(TestServer(create_app(engine, ServerConfig(slo=["ttft:500", "tpot:100"])))) as client:
            assert (await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"})).status == 200
            assert (
                await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "n": 0})
            ).status == 400
            engine.push_stats(SchedulerStats(num_running=1, num_waiting=0, kv_used_tokens=16, kv_total_tokens=64))
            return await (await client.get("/metrics")).text()

    text = asyncio.run(go())
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return exprs + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_every_metric_the_dashboard_queries_is_exposed():
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in _queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert len(used) >= 20
    missing = used - _exposed_sample_names()
    assert not missing, f"the dashboard queries metrics /metrics does not have: {sorted(missing)}"


def test_the_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        assert p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
