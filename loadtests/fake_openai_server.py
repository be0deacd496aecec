"""A scripted OpenAI-compatible streaming server (aiohttp), for testing the benchmark and Locust user.

It produces no real text: each request gets `max_tokens` chunks "tok0 ", "tok1 ", ... after a
fixed delay before the first and between the others, then a usage chunk when
`stream_options.include_usage` is set. Prompt tokens are counted as whitespace-separated words.
A prompt containing `FAIL_HTTP` is answered with HTTP 500; one containing `FAIL_STREAM` gets an
error event after its first chunk. Run it standalone with `python -m batchserve.loadtests.fake_openai_server`;
it ignores flags it does not know, so `batchserve bench --compare --serve-command` can start it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeServerScript:
    ttft_s: float = 0.005
    token_interval_s: float = 0.002
    received: list[dict[str, Any]] = field(default_factory=list)  # every request body, for assertions


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )


def build_app(script: FakeServerScript) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "body is not JSON")
        script.received.append(body)
        text = _prompt_text(body)
        if "FAIL_HTTP" in text:
            return _error(500, "scripted failure")
        max_tokens = int(body.get("max_tokens") or 16)
        prompt_tokens = len(text.split())
        if not body.get("stream"):
            await asyncio.sleep(script.ttft_s + script.token_interval_s * max(0, max_tokens - 1))
            out = "".join(f"tok{i} " for i in range(max_tokens))
            choice = {
                "index": 0,
                "finish_reason": "length",
                **({"message": {"role": "assistant", "content": out}} if chat else {"text": out}),
            }
            return web.json_response(
                {
                    "id": "fake",
                    "object": "chat.completion" if chat else "text_completion",
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": max_tokens,
                        "total_tokens": prompt_tokens + max_tokens,
                    },
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # OpenAI sends the role first, in a chunk without content
            await send({"id": "fake", "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(script.ttft_s)
        for i in range(max_tokens):
            if i > 0:
                await asyncio.sleep(script.token_interval_s)
            piece = f"tok{i} "
            last = i == max_tokens - 1
            choice = {
                "index": 0,
                "finish_reason": "length" if last else None,
                **({"delta": {"content": piece}} if chat else {"text": piece}),
            }
            await send({"id": "fake", "object": kind, "choices": [choice]})
            if "FAIL_STREAM" in text:
                await send({"error": {"message": "scripted stream failure", "code": 500}})
                return resp
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(
                {
                    "id": "fake",
                    "object": kind,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": max_tokens,
                        "total_tokens": prompt_tokens + max_tokens,
                    },
                }
            )
        await send("[DONE]")
        return resp

    async def text_completions(request: web.Request) -> web.StreamResponse:
        return await completions(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await completions(request, chat=True)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", text_completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


class FakeServerThread:
    """The fake server on 127.0.0.1 in a background thread with its own event loop (for tests)."""

    def __init__(self, script: FakeServerScript | None = None):
        self.script = script or FakeServerScript()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)  # type: ignore[union-attr]
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        self._runner = web.AppRunner(build_app(self.script))
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ttft-ms", type=float, default=5.0)
    parser.add_argument("--token-interval-ms", type=float, default=2.0)
    args, _unknown = parser.parse_known_args(argv)  # tolerate `serve` flags such as --policy
    script = FakeServerScript(ttft_s=args.ttft_ms / 1000, token_interval_s=args.token_interval_ms / 1000)
    started = time.strftime("%H:%M:%S")
    print(f"{started} fake OpenAI server on http://{args.host}:{args.port}", flush=True)
    web.run_app(build_app(script), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
