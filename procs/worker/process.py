"""The worker process: loads the model (`ModelRunner`), announces what it holds, executes steps.

Ready once the model is loaded: it then sends `WorkerInfo` to the scheduler (again every few
seconds while idle, so a restarted scheduler learns it too). Each `ForwardBatch` arrives as views
of the scheduler's shared-memory double buffer; the sampled ids go back through the worker's own.
SIGTERM: finish the step in progress, then exit 0.

Tensor parallelism (`procs.worker.parallel`): one worker process per rank, `--local-rank` naming it
on its machine. Global rank 0 is the worker described above; the others only follow it
(`ModelRunner.follow`), heartbeating as `worker-RANK`. A follower asked to stop keeps following until
rank 0 stops it (a stop of the whole server), or `FOLLOWER_STOP_GRACE_S` has passed (a stop of the
follower alone, which ends the group: rank 0's next collective fails and it exits too).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec

from batchserve.procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from batchserve.shared.config import ServerConfig
from batchserve.shared.ipc import Receiver, SchedulerInbox, Sender, StepsInbox, WorkerInbox
from batchserve.shared.messages import ForwardBatch
from batchserve.shared.parallel import RankLayout, worker_rank_name
from batchserve.shared.process_messages import WorkerInfo
from batchserve.shared.shm import DoubleBuffer

if TYPE_CHECKING:  # torch is imported only once the process runs
    from batchserve.procs.worker.model_runner import ModelRunner

log = logging.getLogger("batchserve.worker")
ANNOUNCE_INTERVAL_S = 2.0
FOLLOWER_STOP_GRACE_S = 5.0


def run(config: ServerConfig, local_rank: int = 0) -> int:
    from batchserve.procs.worker.parallel import TensorParallelError

    layout = RankLayout.of(config, local_rank)
    try:
        if layout.rank > 0:
            return _follow(config, layout.rank, local_rank)
        return _lead(config)
    except TensorParallelError as exc:  # the ranks never met: one line says where and why, no traceback
        log.error("%s", exc)
        return 1


def _follow(config: ServerConfig, rank: int, local_rank: int) -> int:
    from batchserve.procs.worker.model_runner import ModelRunner

    with ProcessRuntime(worker_rank_name(rank), config) as rt:
        stop_deadline: float | None = None

        def keep_following() -> bool:
            nonlocal stop_deadline
            rt.alive()
            if rt.stopping.is_set():
                stop_deadline = stop_deadline or time.monotonic() + FOLLOWER_STOP_GRACE_S
                return time.monotonic() < stop_deadline
            return True

        runner = ModelRunner.from_config(config, local_rank)
        log.info("model loaded", extra={"fields": {"rank": rank, "device": str(runner.device)}})
        rt.ready()
        try:
            if not rt.stopping.is_set():  # asked to stop while joining: leave at once, rank 0 has no step yet
                runner.follow(keep_following)
        finally:
            runner.close()
        return 0


def _lead(config: ServerConfig) -> int:
    from batchserve.procs.worker.kv_cache import GIB
    from batchserve.procs.worker.model_runner import ModelRunner
    from batchserve.procs.worker.step_probe import probe_step_costs

    result_buffer = DoubleBuffer("results", half_bytes=1 << 16)
    try:
        with ProcessRuntime("worker", config) as rt:  # closed before the buffer: no send reads it after
            inbox: Receiver[WorkerInbox] = Receiver(rt.ctx, rt.endpoints.worker, ForwardBatch)
            to_steps: Sender[StepsInbox] = Sender(rt.ctx, rt.endpoints.steps, writer=result_buffer)
            to_scheduler: Sender[SchedulerInbox] = Sender(rt.ctx, rt.endpoints.scheduler)
            started = time.monotonic()
            runner = ModelRunner.from_config(config)
            try:
                runner.grammars.prepare()  # at start, rather than a stalled step at the first grammar
                # The scheduler sizes steps to --max-step-ms from these timings (none needed without a bound).
                info = msgspec.structs.replace(
                    runner.worker_info(None if config.max_step_ms < 0 else probe_step_costs(runner)), pid=os.getpid()
                )
                log.info(
                    "model loaded",
                    extra={
                        "fields": {
                            "model": config.model,
                            "device": str(runner.device),
                            "dtype": str(runner.dtype),
                            "quantization": config.quantization,
                            "tensor_parallel_size": config.tensor_parallel_size,
                            "kv_capacity_tokens": info.kv_capacity_tokens,
                            "max_context": info.max_context,
                            # requests that can each hold a whole context at once (more run when they are shorter)
                            "full_context_requests": info.kv_capacity_tokens // info.max_context,
                            "kv_gib": round(runner.kv_cache.memory_bytes / GIB, 2),
                            "seconds": round(time.monotonic() - started, 2),
                        }
                    },
                )
                to_scheduler.send(info)
                rt.ready()
                _serve_steps(rt, runner, info, inbox, to_steps, to_scheduler)
            finally:
                runner.close()
            return 0
    finally:
        result_buffer.close()


def _serve_steps(
    rt: ProcessRuntime,
    runner: ModelRunner,
    info: WorkerInfo,
    inbox: Receiver[WorkerInbox],
    to_steps: Sender[StepsInbox],
    to_scheduler: Sender[SchedulerInbox],
) -> None:
    """Execute each step the scheduler sends until asked to stop; while idle, tick the other ranks and
    announce `info` again now and then (a restarted scheduler learns it so)."""
    announced = time.monotonic()
    while not rt.stopping.is_set():
        rt.alive()
        batch = inbox.recv(POLL_INTERVAL_S)
        if batch is None:
            runner.rank_steps.tick()
            if time.monotonic() - announced > ANNOUNCE_INTERVAL_S:
                to_scheduler.send(info)
                announced = time.monotonic()
            continue
        to_steps.send(runner.execute(batch))
        announced = time.monotonic()
