"""Drive a workload through a sender: fixed concurrency or Poisson arrivals, warm-up excluded.

A sender is any `async (RequestSpec) -> RequestResult`: the HTTP client bound to an endpoint, or
the in-process transformers baseline. Both are measured by the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from batchserve.loadtests.client import RequestResult
from batchserve.loadtests.metrics import BenchMetrics, summarize
from batchserve.loadtests.workload import RequestSpec, poisson_arrivals

Sender = Callable[[RequestSpec], Awaitable[RequestResult]]


@dataclass(frozen=True)
class LoadPoint:
    """One point of a sweep: exactly one of `concurrency` and `request_rate` is set."""

    concurrency: int | None = None
    request_rate: float | None = None  # requests/s, inf allowed; Poisson arrivals
    # With `concurrency`: stream k sends its first request k * stagger_s seconds after stream 0's (clients
    # arriving one by one, so that prompts land beside the decodes of those before them).
    stagger_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load point needs exactly one of concurrency and request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if self.stagger_s < 0 or (self.stagger_s and self.concurrency is None):
            raise ValueError(f"a stagger (>= 0 s) goes with a concurrency, got {self.stagger_s}")

    @property
    def axis(self) -> str:
        return "concurrency" if self.concurrency is not None else "request_rate"

    @property
    def value(self) -> float:
        return float(self.concurrency if self.concurrency is not None else self.request_rate)  # type: ignore[arg-type]

    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}" + (f" +{self.stagger_s:g}s" if self.stagger_s else "")
        return f"rate {self.request_rate:g}/s"


class Progress:
    """A progress bar on stderr: tqdm when installed, else a plain counter line."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.done, self.desc, self.enabled = total, 0, desc, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
            except ImportError:
                self._print()

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            self._print()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)

    def _print(self) -> None:
        print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)


async def run_concurrency(
    send: Sender,
    specs: Sequence[RequestSpec],
    concurrency: int,
    progress: Progress | None = None,
    stagger_s: float = 0.0,
) -> list[RequestResult]:
    """Keep `concurrency` requests in flight: a new one is sent as soon as one finishes (stream k
    starts `k * stagger_s` seconds late)."""
    results: list[RequestResult | None] = [None] * len(specs)
    next_index = 0

    async def worker(k: int) -> None:
        nonlocal next_index
        await asyncio.sleep(k * stagger_s)
        while next_index < len(specs):
            i = next_index
            next_index += 1
            results[i] = await send(specs[i])
            if progress:
                progress.update()

    await asyncio.gather(*(worker(k) for k in range(min(concurrency, len(specs)))))
    return [r for r in results if r is not None]


async def run_conversations(
    send: Sender, specs: Sequence[RequestSpec], concurrency: int, progress: Progress | None = None
) -> list[RequestResult]:
    """Keep `concurrency` conversations going; each sends its turns one after the other, every turn
    with the history so far (its earlier questions and the answers they got)."""
    chats: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        chats.setdefault(spec.conversation, []).append(spec)  # type: ignore[arg-type]
    queue = list(chats.values())
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            turns = sorted(queue.pop(0), key=lambda s: s.turn)
            history = turns[0].history
            for spec in turns:
                result = await send(dataclasses.replace(spec, history=history))
                result.turn = spec.turn
                results.append(result)
                if progress:
                    progress.update()
                if not result.success:
                    break  # the rest of this conversation would build on nothing
                history = (*history, ("user", spec.prompt), ("assistant", result.text))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(queue)))))
    return results


async def run_rate(
    send: Sender, specs: Sequence[RequestSpec], request_rate: float, seed: int, progress: Progress | None = None
) -> list[RequestResult]:
    """Send request i at its Poisson arrival time, whatever is still in flight."""
    offsets = poisson_arrivals(len(specs), request_rate, seed)
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result = await send(specs[i])
        if progress:
            progress.update()
        return result

    return list(await asyncio.gather(*(one(i) for i in range(len(specs)))))


async def measure(
    send: Sender,
    specs: Sequence[RequestSpec],
    point: LoadPoint,
    seed: int,
    warmup: Sequence[RequestSpec] = (),
    desc: str = "bench",
    show_progress: bool = True,
) -> tuple[BenchMetrics, list[RequestResult]]:
    """Warm up (results discarded), then run `specs` at `point` and summarize."""
    if warmup:
        await run_concurrency(send, warmup, min(len(warmup), point.concurrency or len(warmup)))
    progress = Progress(len(specs), desc, enabled=show_progress)
    start = time.perf_counter()
    try:
        if any(spec.conversation is not None for spec in specs):
            if point.concurrency is None:
                raise ValueError(
                    "multi-turn conversations run at a concurrency (conversations in flight), not at a request rate"
                )
            results = await run_conversations(send, specs, point.concurrency, progress)
        elif point.concurrency is not None:
            results = await run_concurrency(send, specs, point.concurrency, progress, point.stagger_s)
        else:
            results = await run_rate(send, specs, point.request_rate, seed, progress)  # type: ignore[arg-type]
    finally:
        progress.close()
    end = max((r.end_time for r in results), default=time.perf_counter())
    return summarize(results, max(end - start, 1e-9)), results
