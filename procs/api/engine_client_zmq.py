"""The api process's `EngineClient`: requests to the tokenizer, answers from the api socket.

One reader task receives everything addressed to the api (`TextDelta`, `RequestRejected` from the
tokenizer/scheduler/detokenizer, `SchedulerStats`, `Heartbeat`, `BackendFailure`, the tokenizer's
`TokenizeAnswer` / `DetokenizeAnswer`) and routes request events to the per-request queue of
`generate` (or of `tokenize` / `detokenize`, which wait for one answer).

A prompt text longer than `max_prompt_chars` is refused here, never sent: it cannot fit the context.

Failure: a watch task looks at the backend processes every `WATCH_INTERVAL_S`. A process that was
ready and then dies (its pid is gone, checked where it runs on this host), stops sending heartbeats,
or is reported stalled by the scheduler (`BackendFailure`) puts the client in a failed state: every
request in flight ends at once with a 503 `RequestRejected` naming the cause, and new requests are
refused, until every backend process has been restarted (new pids, ready again), or, one that had only
gone silent and still runs, sends heartbeats again. The api process
does the same to whatever is still running when its drain times out (`fail_all`).

The backend processes are the tokenizer, scheduler, detokenizer and this machine's worker ranks
(`backend_processes`: `worker`, and `worker-1`... with tensor parallelism): a follower rank that dies
or hangs fails the requests in flight as the worker does. Ranks on other machines are watched by
rank 0, whose collectives fail when one of them is gone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq.asyncio

from batchserve.procs.api.engine_client import EngineEvent, PromptTokens, StatsListener
from batchserve.shared.checks import check_prompt_size
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.ipc import ApiInbox, AsyncReceiver, AsyncSender, Endpoints, TokenizerInbox
from batchserve.shared.liveness import pid_gone
from batchserve.shared.messages import (
    AbortRequest,
    AdapterUpdate,
    GenerateRequest,
    RequestRejected,
    SchedulerStats,
    TextDelta,
)
from batchserve.shared.parallel import worker_process_names
from batchserve.shared.process_messages import PROCESS_NAMES, BackendFailure, Heartbeat
from batchserve.shared.tokenize_messages import DetokenizeAnswer, DetokenizeQuery, TokenizeAnswer, TokenizeQuery

log = logging.getLogger("batchserve.api")

BACKEND_PROCESSES = tuple(name for name in PROCESS_NAMES if name != "api")
HEARTBEAT_STALE_S = 3.5  # heartbeats come every second; three missed ones mean the process is gone
WATCH_INTERVAL_S = 0.1


def backend_processes(config: ServerConfig) -> tuple[str, ...]:
    """The processes the api watches for `config`: this machine's worker ranks in the worker's place."""
    return tuple(
        rank for name in BACKEND_PROCESSES for rank in (worker_process_names(config) if name == "worker" else (name,))
    )


@dataclass(frozen=True)
class _Beat:
    at: float  # time.monotonic() of arrival
    pid: int
    ready: bool
    local: bool  # the process runs on this host: its pid can be checked


class ZmqEngineClient:
    def __init__(
        self,
        endpoints: Endpoints,
        model_name: str,
        max_context: int,
        backends: tuple[str, ...] = BACKEND_PROCESSES,
        *,
        max_prompt_chars: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.backends = backends
        self.model_name = model_name
        self.max_context = max_context
        self.max_prompt_chars = max_prompt_chars  # shared.checks.max_prompt_chars of the model
        self.vocab_size = vocab_size  # ids below it are surely in the vocabulary (the OpenAPI document's bound)
        self.draining = False
        self.failure: str | None = None  # why the backend cannot serve; None: it can (or is starting)
        self._failed_pids: dict[str, int] = {}  # the processes to be restarted before the failure clears
        # failed by silence alone (alive, no heartbeat): back when their heartbeats are (a starved machine)
        self._stalled: set[str] = set()
        self._streams: dict[str, asyncio.Queue[Any]] = {}  # rid -> its events (or its one answer)
        self._heartbeats: dict[str, _Beat] = {}
        self._host = socket.gethostname()
        self._stats_listener: StatsListener | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._to_tokenizer: AsyncSender[TokenizerInbox] | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle (awaited by the app on its loop)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        inbox: AsyncReceiver[ApiInbox] = AsyncReceiver(self._ctx, self.endpoints.api, ApiInbox)
        self._to_tokenizer = AsyncSender(self._ctx, self.endpoints.tokenizer)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read(inbox)), loop.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            try:
                await task
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
                if isinstance(message, (TextDelta, RequestRejected, TokenizeAnswer, DetokenizeAnswer)):
                    queue = self._streams.get(message.rid)
                    if queue is not None:  # else: the request was aborted and forgotten
                        queue.put_nowait(message)
                elif isinstance(message, Heartbeat):
                    self._heartbeats[message.process] = _Beat(
                        time.monotonic(), message.pid, message.ready, message.host == self._host
                    )
                elif isinstance(message, SchedulerStats) and self._stats_listener is not None:
                    self._stats_listener(message)
                elif isinstance(message, BackendFailure):
                    # The scheduler exits after reporting: both it and the process it names restart.
                    self._stalled.discard(message.process)
                    self._fail(
                        f"the {message.process} process stopped making progress: {message.reason}",
                        (message.process, "scheduler"),
                    )
        finally:
            inbox.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            lost = self._lost_backends()
            if self.failure is None:
                if lost:
                    self._fail(*lost[0])
                continue
            for _, names in lost:  # gone after the first (a rank's peers fail with it): restarted too
                self._remember_failed(names)
            # Not in a tick that found a process gone: its restart is not seen yet.
            if (
                not lost
                and self.backends_ready()
                and all(self._back(name, pid) for name, pid in self._failed_pids.items())
            ):
                log.warning("every backend process is ready again; serving", extra={"fields": {"after": self.failure}})
                self.failure = None
                self._failed_pids = {}
                self._stalled = set()

    def _lost_backends(self) -> list[tuple[str, tuple[str, ...]]]:
        """The backend processes that were ready and are gone: (why, (its name,)) each."""
        now = time.monotonic()
        lost: list[tuple[str, tuple[str, ...]]] = []
        for name in self.backends:
            beat = self._heartbeats.get(name)
            if beat is None or not beat.ready or self._failed_pids.get(name) == beat.pid:
                continue  # still starting (not a failure), or already counted
            if beat.local and pid_gone(beat.pid):
                lost.append((f"the {name} process (pid {beat.pid}) exited", (name,)))
            elif now - beat.at > HEARTBEAT_STALE_S:
                self._stalled.add(name)
                lost.append(
                    (
                        f"the {name} process (pid {beat.pid}) sent no heartbeat for {now - beat.at:.1f} s "
                        f"(stopped or hung)",
                        (name,),
                    )
                )
        return lost

    def _back(self, name: str, failed_pid: int) -> bool:
        """Whether a failed backend process serves again: restarted (another pid), or, where it had only gone
        silent (a machine starved of CPU stalls a process for seconds), alive and sending heartbeats again. A
        process that exited, or that its peers reported stuck (`BackendFailure`), must be restarted."""
        beat = self._heartbeats[name]
        if beat.pid != failed_pid:
            return True
        alive = not (beat.local and pid_gone(beat.pid))
        return name in self._stalled and alive and time.monotonic() - beat.at <= HEARTBEAT_STALE_S

    def _fail(self, reason: str, processes: tuple[str, ...]) -> None:
        if self.failure is None:
            log.error("backend failure: %s; failing %d requests in flight", reason, len(self._streams))
            self.failure = reason
        self._remember_failed(processes)
        self.fail_all(f"the server cannot complete this request: {reason}")

    def _remember_failed(self, processes: tuple[str, ...]) -> None:
        for name in processes:
            if name in self._heartbeats:
                self._failed_pids.setdefault(name, self._heartbeats[name].pid)

    def fail_all(self, message: str) -> None:
        """End every request in flight now with a 503 `RequestRejected` carrying `message`, and ask
        the backend (best effort: it may be gone) to drop them."""
        streams, self._streams = self._streams, {}
        for rid, queue in streams.items():
            queue.put_nowait(RequestRejected(rid=rid, status=503, message=message))
        if streams and self._to_tokenizer is not None:
            sender = self._to_tokenizer
            for rid in streams:  # queued by ZeroMQ; a restarted tokenizer ignores unknown ids
                asyncio.get_running_loop().create_task(sender.send(AbortRequest(rid=rid)))

    # ---- EngineClient

    def set_stats_listener(self, listener: StatsListener) -> None:
        self._stats_listener = listener

    def backends_ready(self) -> bool:
        now = time.monotonic()
        for name in self.backends:
            beat = self._heartbeats.get(name)
            if beat is None or not beat.ready or now - beat.at > HEARTBEAT_STALE_S:
                return False
        return True

    def health_problem(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if any(task.done() for task in self._tasks) or not self._tasks:
            return "the api's engine client is not running"
        if self.failure is not None:
            return self.failure
        if not self.backends_ready():
            return "the backend processes are not ready"
        return None

    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineEvent]:
        return self._events(request)

    async def _events(self, request: GenerateRequest) -> AsyncIterator[EngineEvent]:
        assert self._to_tokenizer is not None, "start() was not awaited"
        try:
            check_prompt_size(request, self.max_prompt_chars, self.max_context)
        except Refusal as exc:
            yield RequestRejected(rid=request.rid, status=exc.status, message=exc.message, param=exc.param)
            return
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

    async def tokenize(
        self,
        request: GenerateRequest,
        *,
        add_special_tokens: bool | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        return_token_strs: bool,
    ) -> PromptTokens:
        check_prompt_size(request, self.max_prompt_chars, self.max_context)
        answer = await self._ask(
            TokenizeQuery(
                rid=request.rid,
                request=request,
                add_special_tokens=add_special_tokens,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                return_token_strs=return_token_strs,
            )
        )
        assert isinstance(answer, TokenizeAnswer)
        return PromptTokens(answer.token_ids, answer.token_strs)

    async def detokenize(self, token_ids: list[int]) -> str:
        answer = await self._ask(DetokenizeQuery(rid=f"detok-{uuid.uuid4().hex}", token_ids=token_ids))
        assert isinstance(answer, DetokenizeAnswer)
        return answer.text

    async def _ask(self, query: TokenizeQuery | DetokenizeQuery) -> TokenizeAnswer | DetokenizeAnswer:
        """Send one query to the tokenizer and wait for its answer; a rejection (or `fail_all`) raises."""
        assert self._to_tokenizer is not None, "start() was not awaited"
        problem = self.health_problem()
        if problem is not None:
            raise Refusal(f"the server cannot take requests now ({problem}); retry shortly", status=503)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[query.rid] = queue
        try:
            await self._to_tokenizer.send(query)
            answer = await queue.get()
        finally:
            self._streams.pop(query.rid, None)
        if isinstance(answer, RequestRejected):
            raise Refusal(answer.message, answer.param, status=answer.status)
        return answer

    async def abort(self, rid: str) -> None:
        self._streams.pop(rid, None)
        if self._to_tokenizer is not None:
            await self._to_tokenizer.send(AbortRequest(rid=rid))

    async def update_adapter(self, update: AdapterUpdate) -> None:
        if self._to_tokenizer is None:
            raise Refusal("the server cannot take adapter updates now", status=503)
        await self._to_tokenizer.send(update)  # the requests' socket: none sent later overtakes it
