"""The api under careless and hostile clients: bad input answered 400 naming the problem, API keys
(401, checked through the openai client), a stream cut by a backend failure, body and header
deadlines, a cap on open connections, and /health reachable under a slowloris of 5,000 connections."""

from __future__ import annotations

import asyncio
import resource
import time
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine
from test_api_app import sse_events

from batchserve.procs.api.app import create_app
from batchserve.procs.api.server import start_api
from batchserve.shared.config import ServerConfig
from batchserve.shared.ports import free_port


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


@asynccontextmanager
async def serving(engine: FakeEngine, **fields):
    """`start_api` (the api process's own listener: connection cap, deadlines) on a free port."""
    config = ServerConfig(port=free_port(), **fields)
    runner = await start_api(engine, config)
    try:
        yield f"http://127.0.0.1:{config.port}", config.port
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------ 400s naming the problem

DEEP = b'{"prompt": "x", "user": ' + b"[" * 1000 + b"]" * 1000 + b"}"


@pytest.mark.parametrize(
    "body, content_type, param, words",
    [
        (DEEP, "application/json", None, "nests"),
        (
            b'{"prompt": "x", "temperature": 1e9}',
            "application/json",
            "temperature",
            "Expected `float` <= 2.0 - at `$.temperature`",
        ),
        (b'{"prompt": "x", "temperature": 2.5}', "application/json", "temperature", "temperature"),
        (b'{"prompt": "x"}', "text/plain", None, "Content-Type must be application/json"),
        (b'{"prompt": "x"}', "application/x-www-form-urlencoded", None, "Content-Type"),
        (b'{"prompt": "a \\ud800 b"}', "application/json", None, "lone surrogate"),
    ],
)
def test_bad_input_gets_400_naming_the_problem(body, content_type, param, words):
    async def go():
        engine = FakeEngine()
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            resp = await client.post("/v1/completions", data=body, headers={"Content-Type": content_type})
            return resp.status, await resp.json(), engine.requests

    status, out, requests = run(go())
    assert status == 400, out
    assert words in out["error"]["message"] and out["error"]["param"] == param
    assert out["error"]["type"] == "invalid_request_error" and requests == []


def test_temperature_two_is_still_fine():
    async def go():
        async with TestClient(TestServer(create_app(FakeEngine(), ServerConfig()))) as client:
            return (await client.post("/v1/completions", json={"prompt": "x", "temperature": 2})).status

    assert run(go()) == 200


# ------------------------------------------------------------------ a stream cut by a backend failure


def test_a_stream_the_engine_fails_ends_with_abort_an_error_and_done():
    async def go():
        async with TestClient(TestServer(create_app(FakeEngine(fail_after=2), ServerConfig()))) as client:
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            return resp.status, await resp.text()

    status, text = run(go())
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:2]] == ["Hello", ","]
    assert events[-3]["choices"][0]["finish_reason"] == "abort"
    assert events[-2]["error"]["type"] == "service_unavailable_error"
    assert "worker process exited" in events[-2]["error"]["message"]


def test_the_openai_client_raises_on_the_error_event():
    async def go():
        async with serving(FakeEngine(fail_after=1, delay=0.01)) as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            texts = []
            with pytest.raises(openai.APIError, match="worker process exited"):
                async for chunk in await client.completions.create(model="fake-model", prompt="x", stream=True):
                    texts.append(chunk.choices[0].text)
            await client.close()
            return texts

    assert run(go()) == ["Hello", ""]  # the text so far, then the abort chunk, then the error


# ------------------------------------------------------------------ API keys


def test_api_keys_through_the_openai_client(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# batchserve keys\nkey-from-file\n\n")

    async def go():
        async with serving(FakeEngine(), api_key=["key-one", "key-two"], api_key_file=str(key_file)) as (url, _):
            for key in ("key-two", "key-from-file"):
                async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
                    out = await client.completions.create(model="fake-model", prompt="x")
                    assert out.choices[0].text == "Hello, world!"
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError) as info:
                    await client.models.list()
                assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/chat/completions", json={"messages": []}) as resp:
                    body = await resp.json()
                    assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
                    assert body["error"]["code"] == "invalid_api_key" and "API key" in body["error"]["message"]
                for path in ("/health", "/metrics"):  # open: load balancers and Prometheus have no key
                    async with session.get(f"{url}{path}") as resp:
                        assert resp.status == 200, path

    run(go())


def test_unreadable_key_file_is_a_startup_error(tmp_path):
    with pytest.raises(ValueError, match="api_key_file"):
        create_app(FakeEngine(), ServerConfig(api_key_file=str(tmp_path / "missing")))


# ------------------------------------------------------------------ slow clients and many connections


def test_a_body_that_does_not_arrive_gets_408():
    async def go():
        async with serving(FakeEngine(), body_timeout_s=0.5) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
            start = time.monotonic()
            answer = await asyncio.wait_for(reader.readuntil(b"}}"), 10)  # the end of the error body
            writer.close()
            return answer, time.monotonic() - start

    answer, waited = run(go())
    assert answer.startswith(b"HTTP/1.1 408") and b"Connection: close" in answer and b"did not arrive" in answer
    assert 0.4 < waited < 5


def test_headers_that_do_not_arrive_close_the_connection():
    async def go():
        async with serving(FakeEngine(), header_timeout_s=0.5) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            start = time.monotonic()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answer, time.monotonic() - start

    answer, waited = run(go())
    assert answer == b"" and waited < 5


def test_connections_beyond_the_cap_get_503_at_once():
    async def go():
        async with serving(FakeEngine(), max_connections=4) as (url, port):
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.2)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            refused = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            for _, w in held:
                w.close()
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/health") as resp:
                    return refused, resp.status

    refused, health_after = run(go())
    assert (
        refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused and b"too many open connections" in refused
    )
    assert health_after == 200


def test_health_answers_under_a_slowloris_of_5000_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # our 5,000 ends of the connections

    async def go():
        async with serving(FakeEngine()) as (url, port):
            held = []
            for _ in range(5000):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
                held.append(writer)
            start = time.monotonic()
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/health") as resp:
                    status, waited = resp.status, time.monotonic() - start
            for writer in held:
                writer.close()
            return status, waited

    try:
        status, waited = run(go(), timeout=120)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert status == 200 and waited < 5


# ------------------------------------------------------------------ no field silently ignored


@pytest.mark.parametrize(
    "endpoint, field, value",
    [
        ("chat/completions", "functions", [{"name": "f", "parameters": {}}]),
        ("chat/completions", "function_call", "auto"),
        ("chat/completions", "tool_choice", "required"),  # without tools
        ("completions", "suffix", "!"),
        ("completions", "best_of", 2),
        ("chat/completions", "best_of", 3),
    ],
)
def test_fields_not_implemented_are_refused_naming_them(endpoint, field, value):
    async def go():
        body = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}
        async with TestClient(TestServer(create_app(FakeEngine(), ServerConfig()))) as client:
            refused = await client.post(f"/v1/{endpoint}", json={**body, field: value})
            neutral = {"functions": [], "function_call": "none", "tool_choice": "none", "suffix": None, "best_of": 1}[
                field
            ]
            accepted = await client.post(f"/v1/{endpoint}", json={**body, field: neutral, "user": "unknown-ok"})
            return refused.status, await refused.json(), accepted.status

    status, out, neutral_status = run(go())
    assert status == 400 and out["error"]["param"] == field and field in out["error"]["message"]
    assert neutral_status == 200  # its "not used" value, and unknown fields, are fine
