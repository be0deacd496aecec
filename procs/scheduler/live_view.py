"""The scheduler's live view (`shared.scheduler_view`): its requests, slots and KV pages as they stand,
and a summary of each step completed since the last view, for the api's `/dashboard`.

Built with a stats message at most every `process.VIEW_INTERVAL_S` (0.5 s): the running set and the
waiting queue's head only, so its cost does not grow with the queue."""

from __future__ import annotations

import itertools
import time
from collections import deque

from batchserve.procs.scheduler.core import Scheduler
from batchserve.procs.scheduler.request import Request
from batchserve.procs.scheduler.step_output import StepOutput
from batchserve.shared.scheduler_view import STEPS_KEPT, WAITING_SHOWN, KvView, RequestView, SchedulerView, StepView


class StepLog:
    """The steps completed since the last view was built (the latest `STEPS_KEPT`)."""

    def __init__(self) -> None:
        self._steps: deque[StepView] = deque(maxlen=STEPS_KEPT)

    def record(self, out: StepOutput, step_s: float) -> None:
        if not out.batch_size:
            return
        self._steps.append(
            StepView(
                out.step,
                sum(n for _, n in out.prefill),
                len(out.decode),
                out.batch_size,
                round(step_s * 1e3, 2),
                round(out.predicted_s * 1e3, 2) if out.predicted_s is not None else -1.0,
                out.prefill_cap if out.prefill_cap is not None else -1,
            )
        )

    def take(self) -> list[StepView]:
        steps = list(self._steps)
        self._steps.clear()
        return steps


def build_view(sched: Scheduler, steps: list[StepView], now: float | None = None) -> SchedulerView:
    """`sched` as it stands: admitted requests by slot, then the waiting queue's first `WAITING_SHOWN`."""
    started = time.perf_counter()
    now = sched.clock() if now is None else now
    admitted = {
        r.slot: r for r in itertools.chain(sched.prefill_manager.chunking, sched.decode_manager.running.values())
    }
    waiting = itertools.islice(sched.prefill_manager.pending_list, WAITING_SHOWN)
    rows = [_row(sched, r, now) for r in itertools.chain((admitted[slot] for slot in sorted(admitted)), waiting)]
    kv, cache = sched.kv, sched.kv.cache
    pool = KvView(
        page_size=sched.page_size,
        total=sched.num_kv_pages,
        used=sched.allocator.num_used,
        free=sched.allocator.num_free,
        reserved=kv.reserved_pages(),
        cached=cache.num_pages if cache is not None else 0,
        cached_referenced=cache.num_referenced if cache is not None else 0,
    )
    config = sched.config
    return SchedulerView(
        requests=rows,
        num_waiting=sched.num_waiting,
        slots_total=config.max_running_requests,
        slots_used=sched.num_running,
        kv=pool,
        steps=steps,
        policy=config.policy,
        prefill_budget=config.prefill_budget,
        max_step_ms=config.max_step_s * 1e3,
        build_ms=(time.perf_counter() - started) * 1e3,
    )


def _row(sched: Scheduler, request: Request, now: float) -> RequestView:
    """A request as the view shows it: a waiting one holds no slot and no pages yet; its `generated` are the
    tokens generated before a preemption (part of its prompt now)."""
    table, slot = sched.table, request.slot
    admitted = slot >= 0
    return RequestView(
        rid=request.rid,
        status=request.status.value,
        slot=slot,
        prompt_tokens=request.num_prompt_tokens,
        prefilled=min(int(table.kv_len[slot]), request.prompt_len) if admitted else 0,
        generated=int(table.generated[slot]) if admitted else request.num_generated_before,
        max_tokens=request.max_tokens,
        kv_pages=int(table.num_pages[slot] - table.dropped_pages[slot]) if admitted else 0,
        kv_reserved_pages=sched.kv.own_reservation(slot) + int(table.shared_pages[slot]) if admitted else 0,
        cached_tokens=request.cached_tokens,
        priority=request.params.priority,
        adapter=request.params.adapter,
        waited_s=round(now - request.arrived_s, 3),
    )
