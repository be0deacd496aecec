"""`RemoteWorker`: the scheduler process's executor, the worker process behind sockets."""

from __future__ import annotations

import time

import numpy as np

from batchserve.procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from batchserve.procs.scheduler.executor import ExecutorError
from batchserve.procs.scheduler.step_cost import StepCostModel
from batchserve.shared.ipc import Receiver, Sender, StepsInbox, WorkerInbox
from batchserve.shared.liveness import pid_gone
from batchserve.shared.messages import DRAFT_TOKEN, ForwardBatch, StepResult

WORKER_STOP_GRACE_S = 5.0  # after SIGTERM, how long to wait for the step in flight
# A step the cost model predicts long (a big prefill chunk of a large model on a slow CPU: 2048 tokens of a 1B
# model take ~40 s on two cores) is slow, not hung: its wait is this many times its prediction, if longer.
SLOW_STEP_FACTOR = 3.0


class WorkerGone(RuntimeError):
    """The worker stopped answering while we were stopping."""


class WorkerStalled(RuntimeError):
    """No result for a step: the worker process exited, or none came within the step timeout (the
    worker is hung or far too slow)."""


class RemoteWorker:
    """The scheduler's executor: ForwardBatches out, their StepResults back in order. With overlap
    scheduling two steps are in flight (the worker runs one while the next waits in its socket).

    The wait is the scheduler loop's progress watchdog: it never outlasts `step_timeout_s` (or SLOW_STEP_FACTOR
    times the step's predicted time, where the cost model predicts more), and ends at once when the worker
    process (`worker_pid`, from its `WorkerInfo`) is gone."""

    def __init__(
        self, to_worker: Sender[WorkerInbox], results: Receiver[StepsInbox], rt: ProcessRuntime, step_timeout_s: float
    ) -> None:
        self.to_worker = to_worker
        self.results = results
        self.rt = rt
        self.step_timeout_s = step_timeout_s
        self.worker_pid = 0  # 0: not known (no liveness check)
        self.cost: StepCostModel | None = None  # fed every step's time once the worker's probe arrives
        self.expert_load: np.ndarray | None = None  # routed tokens per MoE layer and expert, until taken
        self._sent: dict[int, float] = {}  # step -> when it was sent
        self._last_result = 0.0  # when the previous result came back: a queued step starts then
        self.last_step_s = 0.0  # the latest step's seconds, from its start to its result (the live view's)

    def execute(self, batch: ForwardBatch) -> StepResult:
        self.submit(batch)
        return self.wait(batch)

    def submit(self, batch: ForwardBatch) -> None:
        self.to_worker.send(batch)
        self._sent[batch.step] = time.monotonic()

    def timeout_s(self, batch: ForwardBatch) -> float:
        """How long `batch` may take before the worker counts as stalled."""
        if self.cost is None:
            return self.step_timeout_s
        predicted = self.cost.predict(self.cost.shape(batch.prefix_lens, batch.extend_lens))
        return max(self.step_timeout_s, SLOW_STEP_FACTOR * predicted)

    def wait(self, batch: ForwardBatch) -> StepResult:
        """The result of `batch`, the oldest step in flight."""
        started = max(self._sent.pop(batch.step), self._last_result)
        timeout_s = self.timeout_s(batch)
        stop_seen: float | None = None
        while True:
            result = self.results.recv(POLL_INTERVAL_S)
            if result is not None:
                if result.step != batch.step:
                    raise ExecutorError(f"worker answered step {result.step} for step {batch.step}")
                self._last_result = now = time.monotonic()
                self.last_step_s = now - started
                if result.expert_load is not None:
                    load = np.array(result.expert_load)  # a copy: the result's arrays are shared memory
                    self.expert_load = load if self.expert_load is None else self.expert_load + load
                if self.cost is not None:
                    # With prefill: it fed prompt tokens besides the sampled ones (decode rows sample all theirs).
                    # A draft model's proposing is its own cost, apart from the model's step; one-off work none.
                    self.cost.observe(
                        self.cost.shape(batch.prefix_lens, batch.extend_lens),
                        now - started - result.draft_s - result.setup_s,
                        with_prefill=batch.num_tokens > batch.num_sampled,
                    )
                    if result.draft_s:
                        self.cost.observe_drafts(result.draft_s, int((batch.input_ids == DRAFT_TOKEN).sum()))
                return result
            now = time.monotonic()
            if self.worker_pid and pid_gone(self.worker_pid):
                gone = WorkerGone if self.rt.stopping.is_set() else WorkerStalled
                raise gone(f"the worker process (pid {self.worker_pid}) exited with step {batch.step} in flight")
            if now - started > timeout_s:
                raise WorkerStalled(
                    f"no result for step {batch.step} ({batch.num_requests} requests, "
                    f"{batch.num_tokens} tokens) within the step timeout of {timeout_s:g} s"
                )
            if self.rt.stopping.is_set():
                stop_seen = stop_seen or now
                if now - stop_seen > WORKER_STOP_GRACE_S:
                    raise WorkerGone(f"no result for step {batch.step} from the worker")
