"""The web pages' server side (`procs/api/webui.py`, `live_view.py`): the pages and their files come from
the package folder only, carry a CSP, need no key themselves while the live view's data does, turn off
with --no-webui; the snapshot holds the scheduler's latest view and the history sampled from the api's
own metrics, and its cost is in /metrics. The pages in a real browser: tests/test_webui_browser.py."""

from __future__ import annotations

import asyncio
import urllib.parse
from contextlib import asynccontextmanager

from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.procs.api.live_view import LiveView, quantile
from batchserve.procs.api.metrics import ApiMetrics
from batchserve.procs.api.webui import WEBUI_DIR, webui_files
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import SchedulerStats
from batchserve.shared.scheduler_view import KvView, RequestView, SchedulerView, StepView


def run(coro):
    return asyncio.run(coro)


@asynccontextmanager
async def api(config: ServerConfig | None = None, engine: FakeEngine | None = None):
    async with TestClient(TestServer(create_app(engine or FakeEngine(), config or ServerConfig()))) as client:
        yield client


def _view(rids: list[str]) -> SchedulerView:
    requests = [
        RequestView(
            rid=rid,
            status="running",
            slot=i,
            prompt_tokens=5,
            prefilled=5,
            generated=3,
            max_tokens=9,
            kv_pages=2,
            kv_reserved_pages=4,
            cached_tokens=0,
            priority=0,
            adapter=0,
            waited_s=0.5,
        )
        for i, rid in enumerate(rids)
    ]
    return SchedulerView(
        requests=requests,
        num_waiting=0,
        slots_total=4,
        slots_used=len(rids),
        kv=KvView(page_size=16, total=64, used=2 * len(rids), free=64 - 2 * len(rids), reserved=4 * len(rids)),
        steps=[StepView(7, 0, len(rids), len(rids), 12.5, 11.0, -1)],
        build_ms=0.25,
    )


def test_the_pages_and_their_files_are_served_with_a_csp():
    async def go():
        async with api() as client:
            for path, marker in (("/", "chat.js"), ("/dashboard", "dashboard.js")):
                resp = await client.get(path)
                assert resp.status == 200 and resp.content_type == "text/html"
                assert marker in await resp.text()
                assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
            for name in webui_files():
                resp = await client.get(f"/ui/{name}")
                assert resp.status == 200, name
                assert await resp.read() == (WEBUI_DIR / name).read_bytes()

    run(go())


async def _raw_get(client: TestClient, target: str) -> tuple[int, bytes]:
    """GET `target` exactly as written (no client-side normalisation of dot segments)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_nothing_outside_the_package_folder_is_served():
    served = {body for body, _ in webui_files().values()}

    async def go():
        async with api() as client:
            for name in (
                "../webui.py",
                "..%2fwebui.py",
                "%2e%2e%2fapp.py",
                "..%2f..%2f..%2fpyproject.toml",
                "..%5c..%5capp.py",
                "%2fetc%2fpasswd",
                "nope.js",
                "..",
                "%2e%2e",
                "webui",
                urllib.parse.quote("../../shared/config.py", safe=""),
            ):
                status, body = await _raw_get(client, f"/ui/{name}")
                assert status == 404 or body in served, name  # a dot segment may resolve to a page, never a file
                assert b"import " not in body and b"[tool." not in body and b"root:" not in body, name
            for target in ("/../pyproject.toml", "/dashboard/../../procs/api/app.py", "/%2e%2e/pyproject.toml"):
                status, body = await _raw_get(client, target)
                assert b"import " not in body and b"[project]" not in body, target

    run(go())


def test_no_webui_turns_the_pages_off_but_not_the_data():
    async def go():
        async with api(ServerConfig(webui=False)) as client:
            for path in ("/", "/dashboard", "/ui/chat.js"):
                assert (await client.get(path)).status == 404, path
            assert (await client.get("/dashboard/snapshot")).status == 200

    run(go())


def test_with_api_keys_the_pages_load_and_the_data_needs_a_key():
    async def go():
        async with api(ServerConfig(api_key=["sesame"])) as client:
            assert (await client.get("/")).status == 200
            assert (await client.get("/ui/common.js")).status == 200
            resp = await client.get("/dashboard/snapshot")
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
            resp = await client.get("/dashboard/snapshot", headers={"Authorization": "Bearer sesame"})
            assert resp.status == 200

    run(go())


def test_the_snapshot_holds_the_latest_view_and_its_cost_is_in_metrics():
    async def go():
        engine = FakeEngine()
        async with api(engine=engine) as client:
            empty = await (await client.get("/dashboard/snapshot")).json()
            assert empty["scheduler"] is None and empty["steps"] == []
            engine.push_stats(
                SchedulerStats(
                    num_running=2,
                    num_waiting=0,
                    kv_used_tokens=64,
                    kv_total_tokens=1024,
                    preemptions=1,
                    view=_view(["a", "b"]),
                )
            )
            engine.push_stats(
                SchedulerStats(
                    num_running=1,
                    num_waiting=0,
                    kv_used_tokens=32,
                    kv_total_tokens=1024,
                    preemptions=2,
                    view=_view(["b"]),
                )
            )
            snap = await (await client.get("/dashboard/snapshot")).json()
            assert [r["rid"] for r in snap["scheduler"]["requests"]] == ["b"]
            assert snap["steps"] == [[7, 0, 2, 2, 12.5, 11.0, -1], [7, 0, 1, 1, 12.5, 11.0, -1]]
            assert snap["totals"]["preemptions"] == 3
            metrics = await (await client.get("/metrics")).text()
            assert "batchserve_live_view_request_seconds_count 2.0" in metrics
            assert "batchserve_scheduler_view_build_seconds_total 0.0005" in metrics

    run(go())


def test_history_samples_throughput_and_latency_percentiles_once_a_second():
    now = [0.0]
    metrics = ApiMetrics()
    view = LiveView(metrics, clock=lambda: now[0])
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_used_tokens=256, kv_total_tokens=1024)
    view.observe(stats)
    for second in range(1, 4):
        now[0] = float(second)
        metrics.tokens_delivered += 50
        for _ in range(10):
            metrics.itl.observe(0.05)  # all in the (0.04, 0.06] bucket
        metrics.ttft.observe(0.3)
        view.observe(stats)
    view.observe(stats)  # within the second: no sample
    assert len(view.history) == 3
    last = view.history[-1]
    assert (last.t, last.tokens_per_s, last.waiting, last.running, last.kv_used_ratio) == (3.0, 50.0, 2, 3, 0.25)
    assert 40 < last.itl_p50_ms <= 60 and 40 < last.itl_p99_ms <= 60
    assert 200 < last.ttft_p50_ms <= 300


def test_quantile_reads_a_histogram_as_prometheus_does():
    before = [(0.1, 0.0), (0.2, 0.0), (float("inf"), 0.0)]
    after = [(0.1, 10.0), (0.2, 20.0), (float("inf"), 20.0)]
    assert quantile(0.5, before, after) == 0.1  # the 10th of 20 observations: the first bucket's top
    assert abs(quantile(0.75, before, after) - 0.15) < 1e-12
    assert quantile(0.5, after, after) == -1.0  # nothing observed between the readings
    assert quantile(0.99, before, [(0.1, 0.0), (0.2, 0.0), (float("inf"), 5.0)]) == 0.2
