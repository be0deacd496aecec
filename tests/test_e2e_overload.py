"""End to end: a full waiting queue answers 503 with `Retry-After`, and what was admitted still
completes and frees everything. One request slot and one waiting place: of eight requests sent at
once, at most two are in the server at any time; the others are turned away, not queued forever."""

from __future__ import annotations

import asyncio

import aiohttp
from e2e_server import metric, start_server, wait_until

CONCURRENT = 8


async def _send_all(url: str, model: str) -> list[tuple[int, dict, str | None]]:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:

        async def one() -> tuple[int, dict, str | None]:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                return resp.status, await resp.json(), resp.headers.get("Retry-After")

        return await asyncio.gather(*(one() for _ in range(CONCURRENT)))


def test_full_waiting_queue_gets_503_with_retry_after(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama", with_tokenizer=True)
    server = start_server(
        model,
        tmp_path / "serve.log",
        "--max-running-requests",
        "1",
        "--max-waiting",
        "1",
        "--prefill-budget",
        "64",
        "--kv-capacity-tokens",
        "1024",
    )
    try:
        results = asyncio.run(_send_all(server.url, str(model)))
        statuses = sorted(status for status, _, _ in results)
        assert 503 in statuses and 200 in statuses, statuses
        for status, body, retry_after in results:
            if status == 503:
                assert retry_after is not None and int(retry_after) >= 1
                assert body["error"]["type"] and body["error"]["message"]
            else:
                assert status == 200 and body["usage"]["completion_tokens"] == 48
        assert wait_until(
            lambda: (
                metric(server.url, "batchserve_num_requests_running") == 0
                and metric(server.url, "batchserve_kv_cache_used_tokens") == 0
            ),
            timeout=30,
        )
    finally:
        assert server.stop() == 0


def test_a_burst_admits_exactly_running_plus_waiting(tiny_model_dir, tmp_path):
    """The api's in-flight cap and the scheduler's cap agree: of 200 requests sent at once, exactly
    8 running + 16 waiting are admitted (and complete); every other one gets 503 at once."""
    model = tiny_model_dir("llama", with_tokenizer=True)
    server = start_server(
        model,
        tmp_path / "serve.log",
        "--max-running-requests",
        "8",
        "--max-waiting",
        "16",
        "--kv-capacity-tokens",
        "8192",
    )
    body = {"model": str(model), "prompt": [5, 6, 7], "max_tokens": 450, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[int]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one() -> int:
                async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            return await asyncio.gather(*(one() for _ in range(200)))

    try:
        statuses = asyncio.run(burst())
        assert (statuses.count(200), statuses.count(503)) == (24, 176), sorted(set(statuses))
        assert wait_until(lambda: metric(server.url, "batchserve_num_requests_running") == 0, timeout=30)
    finally:
        assert server.stop() == 0
