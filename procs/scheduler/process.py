"""The scheduler process: the `Scheduler` core driven by sockets.

Startup: wait for the worker's `WorkerInfo` (KV capacity, page size, EOS ids, context length),
size the scheduler by it, then report ready. Loop: take in every queued request and abort, launch
a step on the worker (`RemoteWorker`: ForwardBatch out through a shared-memory double buffer),
and, once two steps are in flight (overlap scheduling; one without it), complete the oldest with
its StepResult: send each request's new tokens to the detokenizer, and `SchedulerStats` to the api
(every ~100 ms while busy, every second while idle).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TypedDict

from batchserve.procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from batchserve.procs.scheduler.config import check_config, overlap_schedule, scheduler_config_from_server
from batchserve.procs.scheduler.core import Scheduler
from batchserve.procs.scheduler.live_view import StepLog, build_view
from batchserve.procs.scheduler.lora.adapter_updates import WorkerAdapters, adapters_in_use
from batchserve.procs.scheduler.remote_worker import RemoteWorker, WorkerGone, WorkerStalled
from batchserve.procs.scheduler.step_cost import cost_model_for
from batchserve.procs.scheduler.step_output import LaunchedStep, StepOutput
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.ipc import ApiInbox, DetokenizerInbox, Receiver, SchedulerInbox, Sender, StepsInbox, WorkerInbox
from batchserve.shared.messages import (
    AbortRequest,
    AdapterUpdate,
    RequestRejected,
    SchedulerStats,
    StepResult,
    TokenizedRequest,
)
from batchserve.shared.process_messages import BackendFailure, WorkerInfo
from batchserve.shared.scheduler_view import SchedulerView
from batchserve.shared.shm import DoubleBuffer

log = logging.getLogger("batchserve.scheduler")

STATS_BUSY_INTERVAL_S = 0.1
STATS_IDLE_INTERVAL_S = 1.0
# The live view rides in at most two stats messages a second: the page polls once a second at most, and a
# view per message (10 a second) cost ~0.4 % of a core with nobody watching.
VIEW_INTERVAL_S = 0.5


class SchedulerLoop:
    def __init__(self, config: ServerConfig, rt: ProcessRuntime, step_buffer: DoubleBuffer) -> None:
        """`step_buffer`: the shared memory the steps' arrays travel in (its owner closes it)."""
        self.config = config
        self.rt = rt
        self.step_buffer = step_buffer
        self._open_sockets(config, rt)
        self.scheduler: Scheduler | None = None
        self.in_flight: deque[LaunchedStep] = deque()  # launched, not completed; oldest first
        self._early: list[TokenizedRequest | AbortRequest | AdapterUpdate] = []
        self.adapters = WorkerAdapters(config)  # the LoRA adapters the worker holds, and its next loads and unloads
        self._batch_sizes: list[int] = []
        self.step_log = StepLog()  # steps since the last stats message, for the live view
        self._queue_times: list[float] = []  # of the requests first admitted since the last stats message
        self._preemptions = 0
        self._out_of_reach_reported = 0  # `Scheduler.steps_out_of_reach` at the last stats message
        self._spec_counts = [0, 0, 0]  # drafts, draft tokens, accepted ones, since the last stats message
        self._cache_counts = (0, 0, 0)
        self._last_stats = 0.0
        self._last_view = 0.0
        self._was_busy = False
        self.overlap = False  # overlap scheduling, decided from the worker's device
        self.weight_bytes = 0  # the worker's weights, from its WorkerInfo, for /metrics

    def _open_sockets(self, config: ServerConfig, rt: ProcessRuntime) -> None:
        self.inbox: Receiver[SchedulerInbox] = Receiver(rt.ctx, rt.endpoints.scheduler, SchedulerInbox)
        self.results: Receiver[StepsInbox] = Receiver(rt.ctx, rt.endpoints.steps, StepResult)
        self.to_worker: Sender[WorkerInbox] = Sender(rt.ctx, rt.endpoints.worker, writer=self.step_buffer)
        self.to_detokenizer: Sender[DetokenizerInbox] = Sender(rt.ctx, rt.endpoints.detokenizer)
        self.to_api: Sender[ApiInbox] = Sender(rt.ctx, rt.endpoints.api)
        self.executor = RemoteWorker(self.to_worker, self.results, rt, config.step_timeout_s)

    def wait_for_worker(self) -> bool:
        """Buffer requests until the worker says what it can hold; False if stopped first."""
        while not self.rt.stopping.is_set():
            message = self.inbox.recv(POLL_INTERVAL_S)
            if isinstance(message, WorkerInfo):
                self._start_scheduler(message)
                for early in self._early:
                    self.handle(early)
                self._early.clear()
                return True
            if message is not None:
                self._early.append(message)
        return False

    def _start_scheduler(self, info: WorkerInfo) -> None:
        """The scheduler sized by the worker's report, with the step-cost model its probe gives (for the
        step-time bound, and for speculative decoding's break-even share)."""
        config = scheduler_config_from_server(self.config, info)
        self.overlap = overlap_schedule(self.config, info)
        self.executor.worker_pid = info.pid
        self.weight_bytes = info.weight_bytes
        self.executor.cost = cost_model_for(config, info)
        self.scheduler = Scheduler(config, eos_token_ids=info.eos_token_ids, cost=self.executor.cost)
        if config.max_step_s:
            assert self.executor.cost is not None
            log.info(
                "step-time bound",
                extra={
                    "fields": {
                        "max_step_ms": round(config.max_step_s * 1000, 1),
                        **self.executor.cost.weights.log_fields(),
                    }
                },
            )
        log.info(
            "worker ready",
            extra={
                "fields": {
                    "kv_capacity_tokens": info.kv_capacity_tokens,
                    "weight_bytes": info.weight_bytes,
                    "page_size": info.page_size,
                    "max_context": info.max_context,
                    "policy": self.config.policy,
                    "overlap_schedule": self.overlap,
                }
            },
        )

    def handle(self, message: SchedulerInbox) -> None:
        assert self.scheduler is not None
        if isinstance(message, TokenizedRequest):
            try:
                self.scheduler.add_request(message.rid, message.prompt_ids, message.params)
            except Refusal as exc:
                self.to_api.send(
                    RequestRejected(rid=message.rid, status=exc.status, message=exc.message, param=exc.param)
                )
        elif isinstance(message, AbortRequest):
            self.scheduler.abort(message.rid)  # unknown / finished: nothing to do
        elif isinstance(message, AdapterUpdate):
            self.adapters.update(message)
        # A repeated WorkerInfo (the worker re-announces itself while idle) needs nothing.

    def run(self) -> None:
        sched = self.scheduler
        assert sched is not None
        depth = 2 if self.overlap else 1  # steps in flight at once
        while not self.rt.stopping.is_set():
            self.rt.alive()
            busy = sched.has_unfinished() or bool(self.in_flight)
            first = self.inbox.recv(0 if busy else POLL_INTERVAL_S)
            if first is not None:
                self.handle(first)
                for message in self.inbox.recv_ready():
                    self.handle(message)
            launched_batch = False
            if sched.has_unfinished():
                launched = sched.launch(drain=self._complete_in_flight)  # sized by the step-time bound, if on
                if launched.batch is not None:
                    launched.batch.adapter_updates = self.adapters.due(launched.batch, sched.requests.values())
                    self.executor.submit(launched.batch)
                    self.in_flight.append(launched)
                    launched_batch = True
                else:
                    self._emit(launched.out)
                    if not self.in_flight and not launched.out.cancelled:
                        waited = self.inbox.recv(0.005)  # nothing could run: wait for a message, not spin
                        if waited is not None:
                            self.handle(waited)
            # Wait for the oldest step once the pipeline is full, or when nothing more was launched.
            if self.in_flight and (len(self.in_flight) >= depth or not launched_batch):
                self._complete_oldest()
            self._maybe_send_stats(busy)

    @property
    def sched(self) -> Scheduler:
        """The scheduler, made once the worker is ready (`wait_for_worker`): before `run` and its steps."""
        assert self.scheduler is not None
        return self.scheduler

    def _complete_oldest(self) -> None:
        launched = self.in_flight.popleft()
        assert launched.batch is not None
        self._emit(self.sched.complete(launched, self.executor.wait(launched.batch)))

    def _complete_in_flight(self) -> None:
        while self.in_flight:
            self._complete_oldest()

    def _emit(self, out: StepOutput) -> None:
        """Send a step's tokens and ends downstream; count what the stats report."""
        for delta in self.sched.token_deltas(out):
            self.to_detokenizer.send(delta)
        if out.preempted:
            self._preemptions += len(out.preempted)
            log.info(
                "preempted",
                extra={
                    "fields": {
                        "step": out.step,
                        "rids": out.preempted,
                        "kv_used_tokens": self.sched.kv_used_tokens,
                        "num_waiting": self.sched.num_waiting,
                    }
                },
            )
        if out.batch_size:
            self._batch_sizes.append(out.batch_size)
            self.step_log.record(out, self.executor.last_step_s)
        self._queue_times += out.queue_times
        if out.drafted:
            self._spec_counts = [
                a + b for a, b in zip(self._spec_counts, (len(out.drafted), out.draft_tokens, out.accepted_tokens))
            ]

    def _maybe_send_stats(self, busy: bool) -> None:
        sched = self.scheduler
        assert sched is not None
        now = time.monotonic()
        just_idle = self._was_busy and not sched.has_unfinished()  # report the empty state at once
        self._was_busy = sched.has_unfinished()
        if not just_idle and now - self._last_stats < (STATS_BUSY_INTERVAL_S if busy else STATS_IDLE_INTERVAL_S):
            return
        self.to_api.send(
            SchedulerStats(
                num_running=sched.num_running,
                num_waiting=sched.num_waiting,
                kv_used_tokens=sched.kv_used_tokens,
                kv_total_tokens=sched.kv_capacity_tokens,
                kv_request_pages_max=sched.kv.max_decoding_pages(),
                model_weight_bytes=self.weight_bytes,
                batch_sizes=self._batch_sizes,
                queue_times=self._queue_times,
                preemptions=self._preemptions,
                steps_target_out_of_reach=sched.steps_out_of_reach - self._out_of_reach_reported,
                kv_reserve_ratio=sched.config.kv_reserve_ratio,
                spec_drafts=self._spec_counts[0],
                spec_draft_tokens=self._spec_counts[1],
                spec_accepted_tokens=self._spec_counts[2],
                expert_load=self.executor.expert_load,
                **self._cache_stats(),
                view=self._live_view(now, force=just_idle),
                **(adapters_in_use(sched.requests.values()) if self.config.enable_lora else {}),
            )
        )
        self.executor.expert_load = None
        self._spec_counts = [0, 0, 0]
        self._batch_sizes = []
        self._queue_times = []
        self._preemptions = 0
        self._out_of_reach_reported = sched.steps_out_of_reach
        self._last_stats = now

    def _live_view(self, now: float, force: bool) -> SchedulerView | None:
        """The live view when `VIEW_INTERVAL_S` has passed since the last (or `force`: the empty state at once)."""
        if not force and now - self._last_view < VIEW_INTERVAL_S:
            return None
        self._last_view = now
        return build_view(self.sched, self.step_log.take())

    def _cache_stats(self) -> CacheStats:
        """The prefix cache's counters since the last stats message, and its size now."""
        kv = self.sched.kv
        if kv.cache is None:
            return {}
        counts = (kv.hit_tokens, kv.queried_tokens, kv.evicted_pages)
        hit, queried, evicted = (now - before for now, before in zip(counts, self._cache_counts))
        self._cache_counts = counts
        return {
            "cache_hit_tokens": hit,
            "cache_queried_tokens": queried,
            "cache_evicted_pages": evicted,
            "cache_pages": kv.cache.num_pages,
            "cache_referenced_pages": kv.cache.num_referenced,
        }


class CacheStats(TypedDict, total=False):
    """`SchedulerStats`' prefix cache fields (left out: no cache)."""

    cache_hit_tokens: int
    cache_queried_tokens: int
    cache_evicted_pages: int
    cache_pages: int
    cache_referenced_pages: int


def run(config: ServerConfig) -> int:
    check_config(config)
    step_buffer = DoubleBuffer("steps")
    try:
        with ProcessRuntime("scheduler", config) as rt:  # closed before the buffer: no send reads it after
            loop = SchedulerLoop(config, rt, step_buffer)
            if not loop.wait_for_worker():
                return 0
            rt.ready()
            try:
                loop.run()
            except WorkerGone as exc:
                log.warning("%s; stopping", exc)
            except WorkerStalled as exc:
                # Every request in flight is lost with the step: the api fails them and answers 503; the
                # supervisor (serve, or systemd's watchdog on the worker) restarts the stack.
                log.error("%s; stopping", exc)
                loop.to_api.send(BackendFailure(process="worker", reason=str(exc)))
                return 1
            return 0
    finally:
        step_buffer.close()
