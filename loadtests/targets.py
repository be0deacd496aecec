"""Things a benchmark can measure: an endpoint URL, this server started under a policy, the transformers baseline.

All are measured on the same workload by the same runner, one `RunRecord` per target and load point.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from batchserve.loadtests.client import Endpoint, RequestResult, make_session, send_request
from batchserve.loadtests.metrics import Slo, summarize
from batchserve.loadtests.report import RunRecord, format_run
from batchserve.loadtests.runner import LoadPoint, Sender, measure
from batchserve.loadtests.server_process import ServerProcess, ServerStartError
from batchserve.loadtests.server_stats import ServerStats, ServerStatsProbe
from batchserve.loadtests.workload import RequestSpec


@dataclass(frozen=True)
class Plan:
    """The workload and the sweep, shared by every target of a run."""

    specs: Sequence[RequestSpec]
    warmup: Sequence[RequestSpec]
    points: Sequence[LoadPoint]
    seed: int
    endpoint: Endpoint
    request_timeout_s: float = 600.0
    show_progress: bool = True
    # per point and round, consecutive slices of `specs`, so that no point or round repeats an earlier
    # one's prompts (a prefix-caching server would answer those from its cache); empty: all of `specs`
    # at every point
    num_prompts: Sequence[int] = ()
    slo: Slo | None = None  # goodput objectives (`--goodput`)

    def specs_for(self, index: int, round: int = 0) -> Sequence[RequestSpec]:
        """Point `index`'s prompts in round `round` (`specs` holds sum(num_prompts) of them per round)."""
        if not self.num_prompts:
            return self.specs
        start = round * sum(self.num_prompts) + sum(self.num_prompts[:index])
        return self.specs[start : start + self.num_prompts[index]]


SenderFactory = Callable[[aiohttp.ClientSession], Sender]


@dataclass(frozen=True)
class OpenTarget:
    """A target, once opened: it turns the shared HTTP session into a sender for its requests, and may
    have a batchserve `/metrics` page to sample while it is measured."""

    sender: SenderFactory
    metrics_url: str | None = None


Opener = Callable[[], AbstractContextManager[OpenTarget]]


@contextlib.contextmanager
def url_target(base_url: str, model: str, endpoint: Endpoint) -> Iterator[OpenTarget]:
    """An already running OpenAI-compatible server (its /metrics is sampled if it is batchserve's)."""
    yield OpenTarget(
        lambda session: functools.partial(send_request, session, base_url, endpoint, model),
        base_url.rstrip("/") + "/metrics",
    )


@contextlib.contextmanager
def server_target(
    policy: str,
    serve_command: Sequence[str],
    model: str,
    max_batch_size: int,
    server_args: Sequence[str],
    log_dir: Path,
    health_timeout_s: float,
    endpoint: Endpoint,
    torch_threads: int = 0,
    label: str = "",
) -> Iterator[OpenTarget]:
    """`serve_command` under `policy` on a free port, stopped when the context ends."""
    command = [
        *serve_command,
        "--model",
        model,
        "--policy",
        policy,
        "--max-running-requests",
        str(max_batch_size),
        *server_args,
    ]
    label = label or policy
    log_path = _free_log_path(log_dir, f"server-{label.replace('/', '-')}")
    print(f"starting {label} server (log: {log_path})", file=sys.stderr, flush=True)
    env = {"OMP_NUM_THREADS": str(torch_threads)} if torch_threads else None  # torch's intra-op threads
    with ServerProcess(command, log_path, health_timeout_s=health_timeout_s, env=env) as server:
        with url_target(server.base_url, model, endpoint) as target:
            yield target


def _free_log_path(log_dir: Path, stem: str) -> Path:
    """`stem`.log, or `stem`-2.log, -3, ... if taken: a server is started again for each measurement."""
    path, n = log_dir / f"{stem}.log", 1
    while path.exists():
        n += 1
        path = log_dir / f"{stem}-{n}.log"
    return path


@contextlib.contextmanager
def transformers_target(
    model_dir: Path, max_batch_size: int, device: str, endpoint: Endpoint, torch_threads: int = 0
) -> Iterator[OpenTarget]:
    """The static-batching baseline, in this process."""
    import torch

    from batchserve.loadtests.hf_baseline import TransformersStaticBatcher

    if torch_threads:
        torch.set_num_threads(torch_threads)
    print(f"loading transformers baseline from {model_dir}", file=sys.stderr, flush=True)
    batcher = TransformersStaticBatcher(model_dir, max_batch_size, endpoint, device)
    try:
        yield OpenTarget(lambda session: batcher.send)
    finally:
        batcher.close()


async def _measure_one(
    target: OpenTarget, plan: Plan, index: int, round: int, rounds: int, label: str
) -> tuple[list[RequestResult], float, ServerStats | None]:
    """One measurement of an opened target: point `index`'s prompts of round `round` (of `rounds`)."""
    point = plan.points[index]
    async with make_session(plan.request_timeout_s) as session:
        probe = ServerStatsProbe(session, target.metrics_url) if target.metrics_url else None
        async with probe or contextlib.nullcontext():
            metrics, results = await measure(
                target.sender(session),
                plan.specs_for(index, round),
                point,
                plan.seed,
                warmup=plan.warmup,
                desc=f"{label} @ {point.label()}",
                show_progress=plan.show_progress,
            )
    if rounds > 1:
        itl_p99 = "-" if metrics.itl_ms.p99 is None else f"{metrics.itl_ms.p99:.0f}"
        print(
            f"{label} @ {point.label()} round {round + 1}/{rounds}: {metrics.output_throughput:.2f} "
            f"output tok/s, ITL p99 {itl_p99} ms",
            file=sys.stderr,
            flush=True,
        )
    return results, metrics.duration_s, probe.stats if probe else None


def _record(
    label: str,
    point: LoadPoint,
    results: list[RequestResult],
    duration: float,
    server: ServerStats | None,
    slo: Slo | None,
) -> RunRecord:
    turns = sorted({r.turn for r in results if r.turn is not None})
    by_turn = {t: summarize([r for r in results if r.turn == t], duration, slo) for t in turns} if turns else None
    return RunRecord(label, point, summarize(results, duration, slo), server, by_turn)


def measure_targets(
    openers: Sequence[tuple[str, Opener]], plan: Plan, rounds: int = 1
) -> tuple[list[RunRecord], list[str]]:
    """Measure every target at every load point, `rounds` times with the order rotated each round;
    the rounds of one (target, point) are pooled: latencies together, tokens over the summed durations.

    Each target is opened for its measurement alone and closed after it: a server started for it is
    stopped before the next one starts. On the 2-core VM this was measured on, a server measured while
    another, started after it, sat idle beside it ran 2-4 % slower, whichever was measured first
    (`loadtests/results/bench_side_by_side_cpu.txt`), and `--compare` started its variants side by side.
    A target that fails to open is reported in the returned errors and not tried again; the others are
    still measured.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    errors: list[str] = []
    failed: set[str] = set()  # targets that did not open: not tried again
    pooled: dict[tuple[str, int], tuple[list[RequestResult], float, ServerStats | None]] = {}
    for i, point in enumerate(plan.points):
        for r in range(rounds):
            shift = r % len(openers)
            for label, opener in [*openers[shift:], *openers[:shift]]:
                if label in failed:
                    continue
                try:
                    with opener() as target:
                        results, duration, stats = asyncio.run(_measure_one(target, plan, i, r, rounds, label))
                except ServerStartError as exc:
                    failed.add(label)
                    errors.append(f"{label}: {exc}")
                    print(f"batchserve bench: error: {label}: {exc}", file=sys.stderr, flush=True)
                    continue
                done, total_s, server = pooled.get((label, i), ([], 0.0, None))
                pooled[(label, i)] = (done + results, total_s + duration, stats.merged(server) if stats else server)
        for label, _ in openers:
            if (label, i) in pooled:
                print(format_run(_record(label, point, *pooled[(label, i)], plan.slo)), flush=True)
    return [
        _record(label, point, *pooled[(label, i)], plan.slo)
        for i, point in enumerate(plan.points)
        for label, _ in openers
        if (label, i) in pooled
    ], errors
