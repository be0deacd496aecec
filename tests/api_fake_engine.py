"""An in-process `EngineClient` test double for the api tests: scripted tokens, delays, rejections."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from shared.messages import GenerateRequest, RequestRejected, SchedulerStats, TextDelta, Usage


class FakeEngine:
    """Answers every request with `tokens` (one TextDelta each, cut at max_tokens), or rejects it.

    Records what the app sent: `requests`, `aborts` (rids, in order) and `closed` (rids whose
    iterator was closed). `prompt_tokens` of a text prompt is its word count, of a chat the words of
    all messages.
    """

    def __init__(self, tokens: list[str] | None = None, *, delay: float = 0.0, first_delay: float = 0.0,
                 reject: tuple[int, str, str | None] | None = None, model_name: str = "fake-model",
                 max_context: int = 128, fail_with: Exception | None = None,
                 fail_after: int | None = None) -> None:
        self.tokens = ["Hello", ",", " world", "!"] if tokens is None else tokens
        self.delay = delay
        self.first_delay = first_delay
        self.reject = reject
        self.fail_with = fail_with
        self.fail_after = fail_after  # tokens streamed before a 503 rejection (a backend that died)
        self.model_name = model_name
        self.max_context = max_context
        self.healthy = True
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.closed: list[str] = []
        self.received = asyncio.Event()  # set when a request arrives
        self.aborted = asyncio.Event()  # set on the first abort
        self._listener = None

    # ---- EngineClient

    def generate(self, request: GenerateRequest) -> AsyncIterator[TextDelta | RequestRejected]:
        return self._run(request)

    async def _run(self, request: GenerateRequest):
        self.requests.append(request)
        self.received.set()
        try:
            if self.first_delay:
                await asyncio.sleep(self.first_delay)
            if self.fail_with is not None:
                raise self.fail_with
            if self.reject is not None:
                status, message, param = self.reject
                yield RequestRejected(rid=request.rid, status=status, message=message, param=param)
                return
            prompt_tokens = self._prompt_tokens(request)
            n = min(len(self.tokens), request.stop.max_tokens)
            reason = "length" if n < len(self.tokens) else "stop"
            for i in range(n):
                if i and self.delay:
                    await asyncio.sleep(self.delay)
                if i == self.fail_after:
                    yield RequestRejected(rid=request.rid, status=503, message="the worker process exited")
                    return
                last = i == n - 1
                yield TextDelta(
                    rid=request.rid, text=self.tokens[i], token_ids=[100 + i],
                    finish_reason=reason if last else None,
                    usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n)
                    if last else None,
                )
        finally:
            self.closed.append(request.rid)

    async def abort(self, rid: str) -> None:
        self.aborts.append(rid)
        self.aborted.set()

    def health_problem(self) -> str | None:
        return None if self.healthy else "the fake engine is unhealthy"

    def set_stats_listener(self, listener) -> None:
        self._listener = listener

    # ---- test controls

    def push_stats(self, stats: SchedulerStats) -> None:
        self._listener(stats)

    @staticmethod
    def _prompt_tokens(request: GenerateRequest) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if request.messages is not None:
            return sum(len(m.content.split()) for m in request.messages)
        return len((request.prompt or "").split())
