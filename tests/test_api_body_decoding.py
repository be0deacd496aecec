"""Request bodies the api cannot decode (issue 31): a Content-Encoding the body is not valid in, an
encoding aiohttp does not decode, no Content-Type or another one than JSON. Each is a 400 with an
OpenAI error body naming the problem, never a 500, and nothing reaches the engine; valid encoded
bodies keep working."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib

import brotli
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.shared.config import ServerConfig

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
PATHS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": json.dumps({"prompt": "hi", "max_tokens": 3}).encode(),
    "/v1/responses": json.dumps({"input": "hi", "max_output_tokens": 3}).encode(),
}
ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress}


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


async def post(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict | str, FakeEngine, bool]:
    """(status, parsed body, the engine, whether the server closed the connection), one server per call."""
    engine = FakeEngine()
    async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
        resp = await client.post(path, data=body, headers=headers, skip_auto_headers=["Content-Type"])
        text = await resp.text()
        closed = resp.headers.get("Connection", "").lower() == "close"
        try:
            return resp.status, json.loads(text), engine, closed
        except json.JSONDecodeError:
            return resp.status, text, engine, closed


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("encoding", ENCODERS)
def test_valid_encoded_bodies_are_decoded(path, encoding):
    status, body, engine, _ = run(
        post(path, ENCODERS[encoding](PATHS[path]), {"Content-Type": "application/json", "Content-Encoding": encoding})
    )
    assert status == 200, body
    assert len(engine.requests) == 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP"])
def test_a_body_not_valid_in_its_content_encoding_is_400_and_closes_the_connection(path, encoding, caplog):
    caplog.set_level(logging.ERROR)
    status, body, engine, closed = run(
        post(path, PATHS[path], {"Content-Type": "application/json", "Content-Encoding": encoding})
    )
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert f"not valid {encoding.lower()} (its Content-Encoding)" in error["message"]
    assert closed  # the rest of the body is unread: the connection cannot carry another request
    assert engine.requests == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a client's error, not the server's


def test_a_truncated_gzip_body_is_400():
    status, body, engine, _ = run(
        post(
            "/v1/chat/completions",
            gzip.compress(CHAT)[:20],
            {"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )
    )
    assert status == 400 and engine.requests == []
    assert "Content-Encoding" in body["error"]["message"] or "JSON" in body["error"]["message"]


@pytest.mark.parametrize("encoding", ["compress", "gzip, br", "x-custom"])
def test_an_encoding_that_is_not_decoded_is_400_naming_it(encoding):
    status, body, engine, closed = run(
        post("/v1/chat/completions", CHAT, {"Content-Type": "application/json", "Content-Encoding": encoding})
    )
    assert status == 400, body
    message = body["error"]["message"]
    assert f"Content-Encoding {encoding.lower()!r} is not supported" in message and "gzip" in message
    assert closed and engine.requests == []


def test_identity_encoding_and_a_json_charset_are_fine():
    for headers in (
        {"Content-Type": "application/json", "Content-Encoding": "identity"},
        {"Content-Type": "application/json; charset=utf-8"},
    ):
        status, body, _, _ = run(post("/v1/chat/completions", CHAT, headers))
        assert status == 200, (headers, body)


def test_a_body_that_decompresses_beyond_the_size_limit_is_413():
    bomb = gzip.compress(b" " * (20 * 1024 * 1024), compresslevel=9)  # 20 MiB of spaces in ~20 KB
    status, body, engine, _ = run(
        post("/v1/chat/completions", bomb, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    )
    assert status == 413, body
    assert body["error"]["type"] == "invalid_request_error" and engine.requests == []


def test_no_content_type_is_400_naming_the_header():
    for path, payload in PATHS.items():
        status, body, engine, _ = run(post(path, payload, {}))
        assert status == 400, (path, body)
        assert "Content-Type header is missing" in body["error"]["message"]
        assert "application/json" in body["error"]["message"]
        assert engine.requests == []


def test_curls_form_default_is_400_naming_the_header():
    # `curl -d '{...}'` without -H sends application/x-www-form-urlencoded
    status, body, engine, _ = run(
        post("/v1/chat/completions", CHAT, {"Content-Type": "application/x-www-form-urlencoded"})
    )
    assert status == 400
    assert body["error"]["message"] == ("Content-Type must be application/json (got application/x-www-form-urlencoded)")
    assert engine.requests == []


def test_the_server_keeps_serving_after_a_bad_body():
    async def go():
        engine = FakeEngine()
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            bad = await client.post(
                "/v1/chat/completions",
                data=CHAT,
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
            good = await client.post("/v1/chat/completions", data=CHAT, headers={"Content-Type": "application/json"})
            return bad.status, good.status, await good.json()

    bad, good, body = run(go())
    assert (bad, good) == (400, 200)
    assert body["choices"][0]["message"]["content"] == "Hello, world"  # FakeEngine's first 3 tokens
