"""The api process's `EngineClient`: requests to the tokenizer, answers from the api socket.

One reader task receives everything addressed to the api (`TextDelta`, `RequestRejected` from the
tokenizer/scheduler/detokenizer, `SchedulerStats`, `Heartbeat`) and routes request events to the
per-request queue of `generate`. Health = every backend process sent a ready heartbeat recently
(and the api is not draining).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import msgspec
import zmq.asyncio

from procs.api.engine_client import EngineEvent, StatsListener
from shared.ipc import ApiInbox, AsyncReceiver, AsyncSender, Endpoints, TokenizerInbox
from shared.messages import AbortRequest, GenerateRequest, Heartbeat, RequestRejected, SchedulerStats, TextDelta

log = logging.getLogger("batchserve.api")

BACKEND_PROCESSES = ("tokenizer", "scheduler", "worker", "detokenizer")
HEARTBEAT_STALE_S = 3.5  # heartbeats come every second; three missed ones mean the process is gone


class ZmqEngineClient:
    def __init__(self, endpoints: Endpoints, model_name: str, max_context: int) -> None:
        self.endpoints = endpoints
        self.model_name = model_name
        self.max_context = max_context
        self.draining = False
        self._streams: dict[str, asyncio.Queue[EngineEvent]] = {}
        self._heartbeats: dict[str, tuple[float, bool]] = {}
        self._stats_listener: StatsListener | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._to_tokenizer: AsyncSender[TokenizerInbox] | None = None
        self._reader: asyncio.Task | None = None

    # ---- lifecycle (awaited by the app on its loop)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        inbox: AsyncReceiver[ApiInbox] = AsyncReceiver(self._ctx, self.endpoints.api, ApiInbox)
        self._to_tokenizer = AsyncSender(self._ctx, self.endpoints.tokenizer)
        self._reader = asyncio.get_running_loop().create_task(self._read(inbox))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        if self._ctx is not None:
            self._ctx.destroy(linger=500)

    async def _read(self, inbox: AsyncReceiver[ApiInbox]) -> None:
        try:
            while True:
                try:
                    message = await inbox.recv()
                except msgspec.DecodeError as exc:  # a peer's bug must not stop all routing
                    log.error("dropped an undecodable message: %s", exc)
                    continue
                if isinstance(message, (TextDelta, RequestRejected)):
                    queue = self._streams.get(message.rid)
                    if queue is not None:  # else: the request was aborted and forgotten
                        queue.put_nowait(message)
                elif isinstance(message, Heartbeat):
                    self._heartbeats[message.process] = (time.monotonic(), message.ready)
                elif isinstance(message, SchedulerStats) and self._stats_listener is not None:
                    self._stats_listener(message)
        finally:
            inbox.close()

    # ---- EngineClient

    def set_stats_listener(self, listener: StatsListener) -> None:
        self._stats_listener = listener

    def backends_ready(self) -> bool:
        now = time.monotonic()
        for name in BACKEND_PROCESSES:
            seen = self._heartbeats.get(name)
            if seen is None or not seen[1] or now - seen[0] > HEARTBEAT_STALE_S:
                return False
        return True

    def is_healthy(self) -> bool:
        return not self.draining and self._reader is not None and not self._reader.done() and self.backends_ready()

    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineEvent]:
        return self._events(request)

    async def _events(self, request: GenerateRequest) -> AsyncIterator[EngineEvent]:
        assert self._to_tokenizer is not None, "start() was not awaited"
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._streams[request.rid] = queue
        try:
            await self._to_tokenizer.send(request)
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, RequestRejected) or event.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request.rid, None)

    async def abort(self, rid: str) -> None:
        self._streams.pop(rid, None)
        if self._to_tokenizer is not None:
            await self._to_tokenizer.send(AbortRequest(rid=rid))
