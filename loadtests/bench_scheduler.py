"""Time one scheduler iteration with 256 running and 1,000 waiting requests (fake executor).

Run: `.venv/bin/python loadtests/bench_scheduler.py [--steps N]`. Scheduler time = `Scheduler.step()`
wall time minus the time spent inside the executor (reported on its own line). Three workloads:

- decode:  prefill-first, every slot decoding, nobody finishing (the steady state of a full server);
- churn:   mixed, ~5 requests finish per step and their slots are refilled from the queue with
           128-token prompts (admission, chunking, page allocation and release every step);
- paged:   as churn, with 16-token pages.

The reference line is a bare Python loop that touches each of the 256 running requests once: the
floor of any per-request Python scheduler, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the checkout seen as batchserve.* (.ci/pythonpath's links)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / ".ci" / "pythonpath"))

from batchserve.procs.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from batchserve.shared.messages import ForwardBatch, RequestParams, StepResult, StopParams

RUNNING = 256
WAITING = 1000
EOS = 2


class TimedFakeExecutor:
    """Vectorised fake model: each sampled token is EOS with probability 1/period (seeded), so
    outputs are ~`period` tokens long and ~RUNNING/period requests end per step."""

    def __init__(self, period: int) -> None:
        self.period = period
        self.rng = np.random.default_rng(0)
        self.seconds = 0.0

    def execute(self, batch: ForwardBatch) -> StepResult:
        t0 = time.perf_counter()
        n = batch.num_sampled
        ids = np.where(self.rng.random(n) * self.period < 1.0, EOS, 100).astype(np.int32)
        result = StepResult(step=batch.step, next_token_ids=ids)
        self.seconds += time.perf_counter() - t0
        return result


def build(policy: str, page_size: int, max_tokens: int) -> tuple[Scheduler, Callable[[], None]]:
    # Room for every slot's full reservation: the queue waits for slots, not for KV.
    config = SchedulerConfig(
        max_running_requests=RUNNING,
        prefill_budget=8192,
        page_size=page_size,
        kv_capacity_tokens=RUNNING * (128 + max_tokens + page_size),
        policy=policy,
    )  # type: ignore[arg-type]
    sched = Scheduler(config, eos_token_ids=(EOS,))
    prompt = list(range(3, 3 + 128))
    counter = [0]

    def refill() -> None:
        while sched.num_waiting < WAITING:
            sched.add_request(f"r{counter[0]}", prompt, RequestParams(stop=StopParams(max_tokens=max_tokens)))
            counter[0] += 1

    refill()
    return sched, refill


def run(name: str, policy: str, page_size: int, period: int, steps: int) -> None:
    sched, refill = build(policy, page_size, max_tokens=steps + 1000 if period == 0 else 900)
    executor = TimedFakeExecutor(period if period else 10**12)
    # Fill all 256 slots (the first steps prefill) before timing.
    for _ in range(100):
        if len(sched.decode_manager.running) == RUNNING:
            break
        sched.step(executor)
        refill()
    sched_times: list[float] = []
    exec_times: list[float] = []
    sizes: list[int] = []
    ended = 0
    for _ in range(steps):
        executor.seconds = 0.0
        t0 = time.perf_counter()
        out = sched.step(executor)
        total = time.perf_counter() - t0
        sched_times.append(total - executor.seconds)
        exec_times.append(executor.seconds)
        sizes.append(out.batch_size)
        ended += len(out.finished)
        refill()
    assert sched.num_waiting == WAITING
    q = statistics.quantiles([t * 1e6 for t in sched_times], n=100)
    print(
        f"{name:<8} scheduler step: median {statistics.median(sched_times) * 1e6:7.1f} us   p90 {q[89]:7.1f} us   "
        f"p99 {q[98]:7.1f} us   | executor median {statistics.median(exec_times) * 1e6:6.1f} us   "
        f"| batch {statistics.fmean(sizes):5.1f} requests, {ended / steps:4.1f} finished/step"
    )


def reference_loop(steps: int) -> None:
    class Req:
        __slots__ = ("kv_len",)

        def __init__(self) -> None:
            self.kv_len = 0

    reqs = [Req() for _ in range(RUNNING)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for r in reqs:
            r.kv_len += 1
        times.append(time.perf_counter() - t0)
    print(
        f"{'ref':<8} bare Python loop over {RUNNING} requests, one attribute update each: "
        f"median {statistics.median(times) * 1e6:7.1f} us"
    )


WORKLOADS = {"decode": ("prefill-first", 1, 0), "churn": ("mixed", 1, 50), "paged": ("mixed", 16, 50)}


def steps_only(workload: str, steps: int) -> None:
    """The workload's warm-up and `steps` steps, untimed: for an instruction count
    (loadtests/scheduler_instructions.sh), where the clock's noise does not reach."""
    policy, page_size, period = WORKLOADS[workload]
    sched, refill = build(policy, page_size, max_tokens=steps + 1000 if period == 0 else 900)
    executor = TimedFakeExecutor(period if period else 10**12)
    for _ in range(100):
        if len(sched.decode_manager.running) == RUNNING:
            break
        sched.step(executor)
        refill()
    for _ in range(steps):
        sched.step(executor)
        refill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steps-only", choices=WORKLOADS, help="run this workload's steps untimed, print nothing")
    args = parser.parse_args()
    if args.steps_only:
        steps_only(args.steps_only, args.steps)
        return 0
    print(f"{RUNNING} running, {WAITING} waiting, {args.steps} timed steps each (target: well under 1000 us)")
    for name, (policy, page_size, period) in WORKLOADS.items():
        run(name, policy, page_size, period, args.steps)
    reference_loop(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
