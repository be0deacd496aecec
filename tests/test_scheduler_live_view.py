"""The scheduler's live view (`procs.scheduler.live_view`): what `/dashboard` shows of the running set,
the waiting queue, the slots, the KV pages and the steps, checked against the chapter's bookkeeping on a
scripted schedule, and carried whole through `SchedulerStats`."""

from __future__ import annotations

import msgspec

from batchserve.procs.scheduler import Scheduler, SchedulerConfig
from batchserve.procs.scheduler.executor import ScriptedExecutor
from batchserve.procs.scheduler.live_view import StepLog, build_view
from batchserve.shared.messages import RequestParams, SchedulerStats, StopParams
from batchserve.shared.scheduler_view import WAITING_SHOWN

PAGE = 4


def _scheduler(requests: int, *, slots: int = 2, prompt: int = 6, max_tokens: int = 5) -> Scheduler:
    config = SchedulerConfig(
        max_running_requests=slots,
        prefill_budget=8,
        kv_capacity_tokens=64,
        page_size=PAGE,
        scheduling_policy="priority",
    )
    sched = Scheduler(config, eos_token_ids=[2], clock=lambda: 10.0)
    for i in range(requests):
        sched.add_request(
            f"r{i}", list(range(3, 3 + prompt)), RequestParams(stop=StopParams(max_tokens=max_tokens), priority=i)
        )
    return sched


def test_the_view_shows_admitted_requests_by_slot_then_the_queue_in_order():
    sched = _scheduler(4)
    log = StepLog()
    executor = ScriptedExecutor(lambda slot: 100)
    # prefill-first, budget 8: step 0 prefills r0 and 2 tokens of r1, step 1 the rest of r1, step 2 decodes both
    for _ in range(3):
        log.record(sched.step(executor), 0.02)
    view = build_view(sched, log.take(), now=12.5)

    assert [(r.rid, r.status, r.slot) for r in view.requests] == [
        ("r0", "running", 0),
        ("r1", "running", 1),
        ("r2", "waiting", -1),
        ("r3", "waiting", -1),
    ]
    r0, r1, r2, _ = view.requests
    assert (r0.prompt_tokens, r0.prefilled, r0.generated, r0.max_tokens) == (6, 6, 2, 5)
    assert (r1.prefilled, r1.generated) == (6, 2)
    # 7 positions of KV (6 prompt, 1 fed back) in 2 pages; the reservation covers the prompt and every token
    # to come (SCHEDULING.md's reservation at rho 1): ceil((6 + 5) / 4) = 3 pages.
    assert (r0.kv_pages, r0.kv_reserved_pages) == (2, 3)
    assert (r2.kv_pages, r2.kv_reserved_pages, r2.priority, r2.waited_s) == (0, 0, 2, 2.5)
    assert (view.slots_total, view.slots_used, view.num_waiting) == (2, 2, 2)
    assert view.kv.used == sum(r.kv_pages for r in view.requests)
    assert view.kv.reserved == sum(r.kv_reserved_pages for r in view.requests)
    assert view.kv.used + view.kv.free == view.kv.total == 16
    assert [(s.step, s.prefill_tokens, s.decode_rows, s.batch_size) for s in view.steps] == [
        (0, 8, 0, 2),
        (1, 4, 0, 1),
        (2, 0, 2, 2),
    ]
    assert all(s.step_ms == 20.0 and s.prefill_cap == -1 for s in view.steps)
    assert log.take() == []  # a step is shown once


def test_the_queue_shown_is_its_head_and_the_count_is_whole():
    sched = _scheduler(WAITING_SHOWN + 10, slots=1)
    view = build_view(sched, [])
    assert len(view.requests) == WAITING_SHOWN and view.num_waiting == WAITING_SHOWN + 10
    assert [r.rid for r in view.requests[:3]] == ["r0", "r1", "r2"]


def test_an_empty_scheduler_after_its_requests_end():
    sched = _scheduler(3, max_tokens=3)
    executor = ScriptedExecutor(lambda slot: 100)
    while sched.has_unfinished():
        sched.step(executor)
    view = build_view(sched, [])
    assert view.requests == [] and view.slots_used == 0 and view.kv.reserved == 0


def test_the_view_travels_in_the_stats_message():
    sched = _scheduler(3)
    view = build_view(sched, [])
    stats = SchedulerStats(num_running=0, num_waiting=3, kv_used_tokens=0, kv_total_tokens=64, view=view)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats)
    assert decoded.view == view
