"""Things a benchmark can measure: an endpoint URL, this server started under a policy, the transformers baseline.

Each returns one `RunRecord` per load point, measured on the same workload by the same runner.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from loadtests.client import Endpoint, make_session, send_request
from loadtests.report import RunRecord, format_run
from loadtests.runner import LoadPoint, Sender, measure
from loadtests.server_process import ServerProcess
from loadtests.workload import RequestSpec


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
    num_prompts: Sequence[int] = ()  # per point (a prefix of `specs`); empty: all of `specs` at every point

    def specs_for(self, index: int) -> Sequence[RequestSpec]:
        return self.specs[: self.num_prompts[index]] if self.num_prompts else self.specs


async def _sweep(label: str, send: Sender, plan: Plan) -> list[RunRecord]:
    records = []
    for i, point in enumerate(plan.points):
        metrics, _ = await measure(send, plan.specs_for(i), point, plan.seed, warmup=plan.warmup,
                                   desc=f"{label} @ {point.label()}", show_progress=plan.show_progress)
        record = RunRecord(label, point, metrics)
        print(format_run(record), flush=True)
        records.append(record)
    return records


def bench_url(label: str, base_url: str, model: str, plan: Plan) -> list[RunRecord]:
    """Measure an already running OpenAI-compatible server."""

    async def run() -> list[RunRecord]:
        async with make_session(plan.request_timeout_s) as session:
            send = functools.partial(send_request, session, base_url, plan.endpoint, model)
            return await _sweep(label, send, plan)

    return asyncio.run(run())


def bench_server(policy: str, serve_command: Sequence[str], model: str, max_batch_size: int,
                 server_args: Sequence[str], log_dir: Path, health_timeout_s: float, plan: Plan,
                 torch_threads: int = 0) -> list[RunRecord]:
    """Start `serve_command` under `policy` on a free port, measure it, stop it."""
    command = [*serve_command, "--model", model, "--policy", policy,
               "--max-running-requests", str(max_batch_size), *server_args]
    log_path = log_dir / f"server-{policy}.log"
    print(f"starting {policy} server (log: {log_path})", file=sys.stderr, flush=True)
    env = {"OMP_NUM_THREADS": str(torch_threads)} if torch_threads else None  # torch's intra-op threads
    with ServerProcess(command, log_path, health_timeout_s=health_timeout_s, env=env) as server:
        return bench_url(policy, server.base_url, model, plan)


def bench_transformers(model_dir: Path, max_batch_size: int, device: str, plan: Plan,
                       torch_threads: int = 0) -> list[RunRecord]:
    """The static-batching baseline, in this process."""
    import torch

    from loadtests.hf_baseline import TransformersStaticBatcher

    if torch_threads:
        torch.set_num_threads(torch_threads)

    print(f"loading transformers baseline from {model_dir}", file=sys.stderr, flush=True)
    batcher = TransformersStaticBatcher(model_dir, max_batch_size, plan.endpoint, device)
    try:
        return asyncio.run(_sweep("transformers", batcher.send, plan))
    finally:
        batcher.close()
