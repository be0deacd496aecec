"""Async streaming client for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

One call sends one request and records, with `time.perf_counter()`, when it was sent, when each
chunk carrying tokens arrived (`sse.carries_token`), and when the stream ended. Token counts come from the final
usage chunk (`stream_options.include_usage`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from batchserve.loadtests.sse import StreamReader
from batchserve.loadtests.workload import RequestSpec

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """What happened to one request. Timestamps are `time.perf_counter()` seconds."""

    success: bool = False
    error: str = ""
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying tokens
    end_time: float = 0.0  # end of the stream (or of the last token, for in-process runners)
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False  # False: counts fell back to the spec / number of token chunks
    text: str = ""
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage's prompt_tokens_details)
    turn: int | None = None  # of a multi-turn conversation


def build_payload(spec: RequestSpec, endpoint: Endpoint, model: str) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": spec.model or model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": spec.temperature,
    }
    if spec.output_len is not None:
        payload["max_tokens"] = spec.output_len
        payload["ignore_eos"] = not spec.stop_at_eos  # so output lengths are exactly as asked
    if spec.seed is not None:
        payload["seed"] = spec.seed
    if endpoint == "chat":
        payload["messages"] = [{"role": role, "content": content} for role, content in spec.history] + [
            {"role": "user", "content": spec.prompt}
        ]
    else:
        payload["prompt"] = spec.prompt
    return payload


async def send_request(
    session: aiohttp.ClientSession, base_url: str, endpoint: Endpoint, model: str, spec: RequestSpec
) -> RequestResult:
    """Send one streaming request; never raises for server or network errors (they become failures)."""
    url = base_url.rstrip("/") + ENDPOINT_PATHS[endpoint]
    result = RequestResult(send_time=time.perf_counter())
    reader = StreamReader()
    try:
        async with session.post(url, json=build_payload(spec, endpoint, model)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {body}"
                result.end_time = time.perf_counter()
                return result
            async for raw in resp.content:  # one SSE line at a time
                if not reader.feed(raw):
                    break
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # ValueError: a malformed event
        result.error = f"{type(exc).__name__}: {exc}"
        result.end_time = time.perf_counter()
        return result
    result.end_time = time.perf_counter()
    result.text = reader.text
    result.chunk_times = reader.chunk_times
    if reader.usage:
        result.prompt_tokens = int(reader.usage.get("prompt_tokens") or 0)
        result.output_tokens = int(reader.usage.get("completion_tokens") or 0)
        result.cached_tokens = int((reader.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        result.usage_reported = True
    result.error = reader.failure()
    result.success = not result.error
    if result.success and not result.usage_reported:
        result.prompt_tokens = spec.input_len
        result.output_tokens = len(result.chunk_times)
    return result


def make_session(timeout_s: float) -> aiohttp.ClientSession:
    """A session with no connection cap (the arrival process decides concurrency), and a fresh
    connection per request: llama.cpp's server closes a keep-alive connection after 5 requests, and
    a request sent on one it has just closed failed to send (12 of 40 at concurrency 16)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )
