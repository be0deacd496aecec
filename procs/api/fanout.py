"""The n choices of one request: each a `GenerateRequest` of its own in the engine (`choice_requests`: ids
rid/j, seeds advanced per choice), read together as one stream of (choice, event) (`_Fanout`), aborted
together when the client goes."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from batchserve.procs.api.engine_client import EngineClient, EngineEvent
from batchserve.shared.messages import GenerateRequest, RequestRejected, TextDelta

logger = logging.getLogger("batchserve.api")


class EngineFailure(Exception):
    """The engine client raised, or its stream ended without a finish_reason."""


class _Run:
    """One choice in the engine: its event stream, and whether the engine is done with it."""

    def __init__(self, index: int, rid: str, events: AsyncIterator[EngineEvent]) -> None:
        self.index = index
        self.rid = rid
        self.events = events
        self.started = False  # its stream is being read: the engine has (or is being sent) the request
        self.ended = False  # a finish_reason or a rejection arrived: no abort needed

    async def next_event(self) -> EngineEvent:
        try:
            event = await self.events.__anext__()
        except StopAsyncIteration:
            raise EngineFailure("the engine ended the request without a finish reason") from None
        except Exception as exc:  # the engine client is broken: answer 500, never a traceback
            logger.exception("engine client failed for %s", self.rid)
            raise EngineFailure(f"engine error: {exc}") from None
        if isinstance(event, RequestRejected) or event.finish_reason is not None:
            self.ended = True
        return event

    async def close(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()


def choice_seed(seed: int, j: int) -> int:
    """Choice j's seed: its own stream, not shared with other seeds' choices (7's choice 1 is not 8's 0)."""
    return seed if j == 0 else (seed * 0x9E3779B97F4A7C15 + j) & (2**63 - 1)


def choice_requests(rid: str, prompts: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """The engine request of every choice, in index order."""
    if len(prompts) * n == 1:
        return prompts
    out = []
    for p, request in enumerate(prompts):
        for j in range(n):
            params = request.params
            seed = params.sampling.seed
            sampling = (
                params.sampling if seed is None else msgspec.structs.replace(params.sampling, seed=choice_seed(seed, j))
            )
            # echo: only choice 0 asks for the prompt's logprobs; the others repeat them (ChoiceOutput)
            logits = params.logits if j == 0 else msgspec.structs.replace(params.logits, prompt_logprobs=None)
            params = msgspec.structs.replace(params, sampling=sampling, logits=logits)
            out.append(msgspec.structs.replace(request, rid=f"{rid}-{p * n + j}", params=params))
    return out


class Fanout:
    """The engine requests of one HTTP request, one per choice, read as one stream of (index, event).

    A prompt is prefilled once: its choice 0 goes first, and its other choices only once choice 0's
    first event shows the prompt computed (its KV is then in the scheduler's prefix cache). A task per
    choice reads its stream into one queue; `close` cancels them and aborts what is still running.
    """

    def __init__(self, engine: EngineClient, requests: list[GenerateRequest], n: int) -> None:
        self.engine = engine
        self.requests = requests
        self.n = n
        self.runs: list[_Run] = []
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue[tuple[int, EngineEvent | EngineFailure]] = asyncio.Queue()
        self._replay: deque[tuple[int, EngineEvent]] = deque()

    def start(self) -> None:
        for index in range(0, len(self.requests), self.n):
            self._submit(index)

    def _submit(self, index: int) -> None:
        request = self.requests[index]
        run = _Run(index, request.rid, self.engine.generate(request))
        self.runs.append(run)
        self._tasks.append(asyncio.get_running_loop().create_task(self._read(run)))

    async def _read(self, run: _Run) -> None:
        run.started = True
        try:
            event = await run.next_event()
            self._queue.put_nowait((run.index, event))
            if run.index % self.n == 0 and isinstance(event, TextDelta):  # the prompt is computed
                for index in range(run.index + 1, run.index + self.n):
                    self._submit(index)
            while not run.ended:
                self._queue.put_nowait((run.index, await run.next_event()))
        except EngineFailure as exc:
            self._queue.put_nowait((run.index, exc))

    async def _get(self) -> tuple[int, EngineEvent]:
        index, item = await self._queue.get()
        if isinstance(item, EngineFailure):
            raise item
        return index, item

    async def started(self) -> RequestRejected | None:
        """Wait until every choice has sent an event (kept for `next`); the first rejection, if any."""
        waiting = set(range(len(self.requests)))
        while waiting:
            index, event = await self._get()
            if isinstance(event, RequestRejected):
                if event.param in ("prompt", "messages") and len(self.requests) > self.n:  # it knows one prompt
                    return msgspec.structs.replace(event, param=f"{event.param}[{index // self.n}]")
                return event
            waiting.discard(index)
            self._replay.append((index, event))
        return None

    async def next(self) -> tuple[int, EngineEvent]:
        """The next event of any choice. Raises EngineFailure."""
        return self._replay.popleft() if self._replay else await self._get()

    async def close(self, abort: Callable[[str], Awaitable[None]]) -> bool:
        """Stop reading; abort every choice the engine has not ended. Whether any was aborted."""
        for task in self._tasks:
            task.cancel()  # from here on no run changes `ended`
        unfinished = [run.rid for run in self.runs if run.started and not run.ended]
        for rid in unfinished:
            await abort(rid)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for run in self.runs:
            await run.close()
        return bool(unfinished)
