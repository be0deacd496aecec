"""The api's connections at their default settings (`start_api`, the api process's own listener): an idle
keep-alive connection lives `keep_alive_timeout_s` (75 s, above a load balancer's 60 s), while a request's
headers get `header_timeout_s` (10 s) from their first byte, on a new connection or a kept one; the
drain on SIGTERM closes idle connections at once; a malformed request is logged at INFO, no traceback.

The first test checks the defaults and then the mechanism at shorter settings (8 s and 3 s), so that it
runs for seconds, not for the 75 s of the default."""

from __future__ import annotations

import asyncio
import logging
import time

from api_fake_engine import FakeEngine

from batchserve.procs.api.server import start_api
from batchserve.shared.config import ServerConfig
from batchserve.shared.ports import free_port

GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    return head + await reader.readexactly(length)


async def _dribble(writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> float:
    """Send a request's headers a byte a second; the seconds until the server closes the connection."""
    start = time.monotonic()
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 200:
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            break
        try:
            if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                break
        except TimeoutError:
            continue
    return time.monotonic() - start


KEEP_ALIVE_S, HEADERS_S = 8.0, 3.0


def test_idle_connections_outlive_their_keep_alive_while_slow_headers_are_cut():
    """Defaults 75 s and 10 s; at 8 s and 3 s: a connection idle for 7.5 s still answers, while headers sent
    a byte a second are cut at 3 s, on a new connection and on a kept one."""

    async def go():
        default = ServerConfig(port=free_port())
        assert (default.keep_alive_timeout_s, default.header_timeout_s) == (75.0, 10.0)
        config = ServerConfig(port=free_port(), keep_alive_timeout_s=KEEP_ALIVE_S, header_timeout_s=HEADERS_S)
        runners = [await start_api(FakeEngine(), default), await start_api(FakeEngine(), config)]
        try:
            said_r, said_w = await asyncio.open_connection("127.0.0.1", default.port)
            said_w.write(GET_HEALTH)
            said = await _answer(said_r)
            open_ = [await asyncio.open_connection("127.0.0.1", config.port) for _ in range(3)]
            (idle_r, idle_w), (kept_r, kept_w), (new_r, new_w) = open_
            for reader, writer in ((idle_r, idle_w), (kept_r, kept_w)):
                writer.write(GET_HEALTH)
                first = await _answer(reader)
            started = time.monotonic()
            cut_new, cut_kept = await asyncio.gather(_dribble(new_w, new_r), _dribble(kept_w, kept_r))
            await asyncio.sleep(KEEP_ALIVE_S - 0.5 - (time.monotonic() - started))
            idle_w.write(GET_HEALTH)
            late = await _answer(idle_r)
            for writer in (said_w, idle_w, kept_w, new_w):
                writer.close()
            return said, first, cut_new, cut_kept, late
        finally:
            for runner in runners:
                await runner.cleanup()

    said, first, cut_new, cut_kept, late = asyncio.run(go())
    assert b"HTTP/1.1 200" in said and b"Keep-Alive: timeout=75" in said
    assert b"HTTP/1.1 200" in first and b"Keep-Alive: timeout=8" in first
    assert HEADERS_S - 1 <= cut_new <= HEADERS_S + 3 and HEADERS_S - 1 <= cut_kept <= HEADERS_S + 3, (cut_new, cut_kept)
    assert late.startswith(b"HTTP/1.1 200")  # 7.5 s idle: still open


def test_the_drain_closes_idle_connections_at_once_and_finishes_streams():
    async def go():
        config = ServerConfig(port=free_port(), drain_timeout_s=30)
        runner = await start_api(FakeEngine(tokens=["a"] * 8, delay=0.25), config)
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", config.port)
        idle_w.write(GET_HEALTH)
        await _answer(idle_r)
        stream_r, stream_w = await asyncio.open_connection("127.0.0.1", config.port)
        body = b'{"prompt": "x", "stream": true, "max_tokens": 8}'
        stream_w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await stream_r.readuntil(b"data:")  # streaming
        started = time.monotonic()
        cleanup = asyncio.create_task(runner.cleanup())
        assert await asyncio.wait_for(idle_r.read(), 5) == b""
        idle_closed = time.monotonic() - started
        rest = await asyncio.wait_for(stream_r.read(), 20)
        await cleanup
        return idle_closed, rest

    idle_closed, rest = asyncio.run(go())
    assert idle_closed < 1.0
    assert b"[DONE]" in rest and b'"finish_reason":"stop"' in rest.replace(b" ", b"")  # whole, not cut


def test_a_malformed_request_line_is_logged_at_info_without_a_traceback(caplog):
    async def go():
        config = ServerConfig(port=free_port())
        runner = await start_api(FakeEngine(), config)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", config.port)
            writer.write(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answer
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.DEBUG):
        answer = asyncio.run(go())
    assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request")  # aiohttp answers the parser's refusal
    assert [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []
    assert any("malformed request" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
