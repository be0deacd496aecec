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
import math
import time
from collections import deque
from dataclasses import dataclass, field

from procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from procs.scheduler.config import SchedulerConfig
from procs.scheduler.core import LaunchedStep, RequestRejectedError, Scheduler, StepOutput
from procs.scheduler.executor import ExecutorError
from procs.scheduler.step_cost import StepCostModel
from shared.config import ServerConfig
from shared.ipc import ApiInbox, DetokenizerInbox, Receiver, SchedulerInbox, Sender, StepsInbox, WorkerInbox
from shared.messages import (
    PROMPT_TAIL_TOKENS,
    AbortRequest,
    BackendFailure,
    ForwardBatch,
    RequestRejected,
    SchedulerStats,
    StepResult,
    TokenDelta,
    TokenizedRequest,
    WorkerInfo,
)
from shared.shm import DoubleBuffer
from shared.step_features import attention_pairs

log = logging.getLogger("batchserve.scheduler")

STATS_BUSY_INTERVAL_S = 0.1
STATS_IDLE_INTERVAL_S = 1.0
DEFAULT_MAX_STEP_MS = {"cpu": 300.0, "cuda": 100.0}
NO_STEP_BOUND = -1.0  # max_step_ms that turns the bound off (config files are JSON: no inf)
# A step sized to the time bound still prefills this much, however long its decodes alone take, so
# that waiting requests always progress.
MIN_PREFILL_TOKENS = 32
WORKER_STOP_GRACE_S = 5.0  # after SIGTERM, how long to wait for the step in flight


class WorkerGone(RuntimeError):
    """The worker stopped answering while we were stopping."""


class WorkerStalled(RuntimeError):
    """No result for a step within the step timeout: the worker is hung, dead or far too slow."""


class RemoteWorker:
    """The scheduler's executor: ForwardBatches out, their StepResults back in order. With overlap
    scheduling two steps are in flight (the worker runs one while the next waits in its socket).

    The wait is the scheduler loop's progress watchdog: it never outlasts `step_timeout_s`."""

    def __init__(self, to_worker: Sender[WorkerInbox], results: Receiver[StepsInbox], rt: ProcessRuntime,
                 step_timeout_s: float) -> None:
        self.to_worker = to_worker
        self.results = results
        self.rt = rt
        self.step_timeout_s = step_timeout_s
        self.cost: StepCostModel | None = None  # fed every step's time once the worker's probe arrives
        self._sent: dict[int, float] = {}  # step -> when it was sent
        self._last_result = 0.0  # when the previous result came back: a queued step starts then

    def execute(self, batch: ForwardBatch) -> StepResult:
        self.submit(batch)
        return self.wait(batch)

    def submit(self, batch: ForwardBatch) -> None:
        self.to_worker.send(batch)
        self._sent[batch.step] = time.monotonic()

    def wait(self, batch: ForwardBatch) -> StepResult:
        """The result of `batch`, the oldest step in flight."""
        started = max(self._sent.pop(batch.step), self._last_result)
        stop_seen: float | None = None
        while True:
            result = self.results.recv(POLL_INTERVAL_S)
            if result is not None:
                if result.step != batch.step:
                    raise ExecutorError(f"worker answered step {result.step} for step {batch.step}")
                self._last_result = now = time.monotonic()
                if self.cost is not None:
                    self.cost.observe(batch.num_tokens, attention_pairs(batch.prefix_lens, batch.extend_lens),
                                      now - started, with_prefill=batch.num_tokens > batch.num_requests)
                return result
            now = time.monotonic()
            if now - started > self.step_timeout_s:
                raise WorkerStalled(f"no result for step {batch.step} ({batch.num_requests} requests, "
                                    f"{batch.num_tokens} tokens) within the step timeout of {self.step_timeout_s:g} s")
            if self.rt.stopping.is_set():
                stop_seen = stop_seen or now
                if now - stop_seen > WORKER_STOP_GRACE_S:
                    raise WorkerGone(f"no result for step {batch.step} from the worker")


@dataclass
class _DeltaState:
    """What one request's next `TokenDelta` needs to carry (counts, and what goes on the first only)."""

    prompt_tokens: int
    stop: tuple[str, ...]
    prompt_tail: list[int]
    generated: int = 0
    started: bool = False
    cached_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)  # kept only when prompt logprobs are asked for


class TokenDeltas:
    """Turns a `StepOutput` into one `TokenDelta` per request (first delta carries the stop strings)."""

    def __init__(self) -> None:
        self.live: dict[str, _DeltaState] = {}

    def add(self, request: TokenizedRequest) -> None:
        prompt = request.prompt_ids
        prompt_ids = prompt.tolist() if request.logits.prompt_logprobs is not None else []
        self.live[request.rid] = _DeltaState(int(prompt.shape[0]), tuple(request.stop.stop),
                                             [int(t) for t in prompt[-PROMPT_TAIL_TOKENS:]], prompt_ids=prompt_ids)

    def from_step(self, out: StepOutput) -> list[TokenDelta]:
        tokens: dict[str, list[int]] = {}
        for rid, token in out.new_tokens:
            tokens.setdefault(rid, []).append(int(token))
        deltas = []
        for rid, cached in out.cached_tokens.items():
            if rid in self.live:
                self.live[rid].cached_tokens = cached
        for rid, ids in tokens.items():
            live = self.live.get(rid)  # read first: the delta that finishes the request forgets it
            delta = self._delta(rid, ids, out.finish_reasons.get(rid))
            if rid in out.logprobs:
                delta.logprobs = [out.logprobs[rid]]
            if rid in out.prompt_logprobs and live is not None:
                delta.prompt_ids = live.prompt_ids
                delta.prompt_logprobs = out.prompt_logprobs[rid]
            deltas.append(delta)
        for rid in out.finished:
            if rid not in tokens:
                deltas.append(self._delta(rid, [], out.finish_reasons.get(rid, "stop")))
        for rid in out.cancelled:
            deltas.append(self._delta(rid, [], "abort"))
        return deltas

    def _delta(self, rid: str, ids: list[int], finish_reason: str | None) -> TokenDelta:
        state = self.live.get(rid)
        if state is None:  # aborted before we tracked it: still close it downstream
            return TokenDelta(rid=rid, token_ids=ids, finish_reason=finish_reason)
        state.generated += len(ids)
        first = not state.started
        state.started = True
        delta = TokenDelta(rid=rid, token_ids=ids, finish_reason=finish_reason, prompt_tokens=state.prompt_tokens,
                           completion_tokens=state.generated, cached_tokens=state.cached_tokens,
                           stop=state.stop if first else (),
                           prompt_tail=state.prompt_tail if first else [])
        if finish_reason is not None:
            del self.live[rid]
        return delta


def scheduler_config_from_server(config: ServerConfig, info: WorkerInfo) -> SchedulerConfig:
    """The server's settings, sized by what the worker reported (KV capacity, page size, context)."""
    return SchedulerConfig(
        max_running_requests=config.max_running_requests, prefill_budget=config.prefill_budget,
        kv_capacity_tokens=info.kv_capacity_tokens, page_size=info.page_size, policy=config.policy,
        max_context=info.max_context, max_waiting=config.max_waiting, kv_reserve_ratio=config.kv_reserve_ratio,
        prefix_cache=not config.disable_prefix_cache,
    )


def step_target_s(config: ServerConfig, info: WorkerInfo) -> float | None:
    """The step-time target in seconds, or None: no bound (-1), or no probe to model steps with."""
    if config.max_step_ms == NO_STEP_BOUND or len({tokens for tokens, _, _ in info.step_costs}) < 2:
        return None
    ms = config.max_step_ms or DEFAULT_MAX_STEP_MS.get(info.device_type, DEFAULT_MAX_STEP_MS["cpu"])
    return ms / 1000


def overlap_schedule(config: ServerConfig, info: WorkerInfo) -> bool:
    """Whether to launch a step before the previous one's tokens are back (`auto`: on a CUDA worker)."""
    return config.overlap_schedule == "on" or (config.overlap_schedule == "auto" and info.device_type == "cuda")


def check_config(config: ServerConfig) -> None:
    """Refuse unworkable scheduler settings at once, before waiting for the model (ValueError)."""
    if not (config.max_step_ms == NO_STEP_BOUND or 0 <= config.max_step_ms < math.inf):  # NaN fails too
        raise ValueError(f"max_step_ms must be -1 (no bound), 0 (the device's suggested target) or a time in ms, "
                         f"got {config.max_step_ms}")
    scheduler_config_from_server(config, WorkerInfo(kv_capacity_tokens=max(config.page_size, 1),
                                                    eos_token_ids=[], max_context=0, page_size=config.page_size))


class SchedulerLoop:
    def __init__(self, config: ServerConfig, rt: ProcessRuntime) -> None:
        self.config = config
        self.rt = rt
        self.step_buffer = DoubleBuffer("steps")
        self.inbox: Receiver[SchedulerInbox] = Receiver(rt.ctx, rt.endpoints.scheduler, SchedulerInbox)
        self.results: Receiver[StepsInbox] = Receiver(rt.ctx, rt.endpoints.steps, StepResult)
        self.to_worker: Sender[WorkerInbox] = Sender(rt.ctx, rt.endpoints.worker, writer=self.step_buffer)
        self.to_detokenizer: Sender[DetokenizerInbox] = Sender(rt.ctx, rt.endpoints.detokenizer)
        self.to_api: Sender[ApiInbox] = Sender(rt.ctx, rt.endpoints.api)
        self.executor = RemoteWorker(self.to_worker, self.results, rt, config.step_timeout_s)
        self.deltas = TokenDeltas()
        self.scheduler: Scheduler | None = None
        self.in_flight: deque[LaunchedStep] = deque()  # launched, not completed; oldest first
        self._early: list[TokenizedRequest | AbortRequest] = []
        self._batch_sizes: list[int] = []
        self._preemptions = 0
        self._cache_counts = (0, 0, 0)
        self._last_stats = 0.0
        self._was_busy = False
        self.step_target_s: float | None = None  # set with the step-cost model, from the worker's info
        self.overlap = False  # overlap scheduling, decided from the worker's device

    def wait_for_worker(self) -> bool:
        """Buffer requests until the worker says what it can hold; False if stopped first."""
        while not self.rt.stopping.is_set():
            message = self.inbox.recv(POLL_INTERVAL_S)
            if isinstance(message, WorkerInfo):
                self.scheduler = Scheduler(scheduler_config_from_server(self.config, message),
                                           eos_token_ids=message.eos_token_ids)
                self.step_target_s = step_target_s(self.config, message)
                self.overlap = overlap_schedule(self.config, message)
                if self.step_target_s is not None:
                    self.executor.cost = StepCostModel(message.step_costs)
                    w0, w1, w2 = self.executor.cost.weights
                    log.info("step-time bound", extra={"fields": {
                        "max_step_ms": round(self.step_target_s * 1000, 1), "ms_per_step": round(w0 * 1000, 2),
                        "ms_per_token": round(w1 * 1000, 4), "ms_per_1k_attention_pairs": round(w2 * 1000, 4)}})
                log.info("worker ready", extra={"fields": {
                    "kv_capacity_tokens": message.kv_capacity_tokens, "page_size": message.page_size,
                    "max_context": message.max_context, "policy": self.config.policy,
                    "overlap_schedule": self.overlap}})
                for early in self._early:
                    self.handle(early)
                self._early.clear()
                return True
            if message is not None:
                self._early.append(message)
        return False

    def handle(self, message: SchedulerInbox) -> None:
        assert self.scheduler is not None
        if isinstance(message, TokenizedRequest):
            try:
                self.scheduler.add_request(message.rid, message.prompt_ids, message.sampling, message.stop,
                                           message.logits)
            except RequestRejectedError as exc:
                self.to_api.send(RequestRejected(rid=message.rid, status=exc.status, message=str(exc),
                                                 param=exc.param))
                return
            self.deltas.add(message)
        elif isinstance(message, AbortRequest):
            self.scheduler.abort(message.rid)  # unknown / finished: nothing to do
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
                launched = sched.launch(self._prefill_tokens(), drain=self._complete_in_flight)
                if launched.batch is not None:
                    self.executor.submit(launched.batch)
                    self.in_flight.append(launched)
                    launched_batch = True
                else:
                    self._emit(launched.out)
                    if not self.in_flight and not launched.out.cancelled:
                        message = self.inbox.recv(0.005)  # nothing could run: wait for a message, not spin
                        if message is not None:
                            self.handle(message)
            # Wait for the oldest step once the pipeline is full, or when nothing more was launched.
            if self.in_flight and (len(self.in_flight) >= depth or not launched_batch):
                self._complete_oldest()
            self._maybe_send_stats(busy)

    def _complete_oldest(self) -> None:
        launched = self.in_flight.popleft()
        assert launched.batch is not None
        self._emit(self.scheduler.complete(launched, self.executor.wait(launched.batch)))  # type: ignore[union-attr]

    def _complete_in_flight(self) -> None:
        while self.in_flight:
            self._complete_oldest()

    def _emit(self, out: StepOutput) -> None:
        """Send a step's tokens and ends downstream; count what the stats report."""
        for delta in self.deltas.from_step(out):
            self.to_detokenizer.send(delta)
        if out.preempted:
            self._preemptions += len(out.preempted)
            log.info("preempted", extra={"fields": {
                "step": out.step, "rids": out.preempted, "kv_used_tokens": self.scheduler.kv_used_tokens,  # type: ignore[union-attr]
                "num_waiting": self.scheduler.num_waiting}})  # type: ignore[union-attr]
        if out.batch_size:
            self._batch_sizes.append(out.batch_size)

    def _prefill_tokens(self) -> int | None:
        """Prompt tokens this step may carry within the step-time target (None: no target)."""
        cost, target = self.executor.cost, self.step_target_s
        if cost is None or target is None:
            return None
        decode_rows, decode_pairs = self.scheduler.decode_load()  # type: ignore[union-attr]
        fits = cost.max_prefill_tokens(target, decode_rows, decode_pairs, self.scheduler.prefill_prefix(),  # type: ignore[union-attr]
                                       self.config.prefill_budget)
        return max(fits, MIN_PREFILL_TOKENS)

    def _maybe_send_stats(self, busy: bool) -> None:
        sched = self.scheduler
        assert sched is not None
        now = time.monotonic()
        just_idle = self._was_busy and not sched.has_unfinished()  # report the empty state at once
        self._was_busy = sched.has_unfinished()
        if not just_idle and now - self._last_stats < (STATS_BUSY_INTERVAL_S if busy else STATS_IDLE_INTERVAL_S):
            return
        self.to_api.send(SchedulerStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                                        kv_used_tokens=sched.kv_used_tokens,
                                        kv_total_tokens=sched.kv_capacity_tokens, batch_sizes=self._batch_sizes,
                                        preemptions=self._preemptions,
                                        kv_reserve_ratio=sched.config.kv_reserve_ratio, **self._cache_stats()))
        self._batch_sizes = []
        self._preemptions = 0
        self._last_stats = now

    def _cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters since the last stats message, and its size now."""
        kv = self.scheduler.kv  # type: ignore[union-attr]
        if kv.cache is None:
            return {}
        counts = (kv.hit_tokens, kv.queried_tokens, kv.evicted_pages)
        hit, queried, evicted = (now - before for now, before in zip(counts, self._cache_counts))
        self._cache_counts = counts
        return {"cache_hit_tokens": hit, "cache_queried_tokens": queried, "cache_evicted_pages": evicted,
                "cache_pages": kv.cache.num_pages, "cache_referenced_pages": kv.cache.num_referenced}


def run(config: ServerConfig) -> int:
    check_config(config)
    rt = ProcessRuntime("scheduler", config)
    rt.install_signal_handlers()
    rt.start_heartbeat()
    loop = SchedulerLoop(config, rt)
    try:
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
        rt.close()
        loop.step_buffer.close()
