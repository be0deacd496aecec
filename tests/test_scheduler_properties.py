"""Property tests: random workloads through the real scheduler, every rule and invariant checked.

`run_and_check` (tests/scheduler_harness.py) audits each ForwardBatch like a worker would and keeps
its own books of procs/scheduler/SCHEDULING.md's quantities, so the scheduler is checked against an independent
model of the rules: FIFO admission at the first step the head fits, reservation never exceeded,
KV pages owned by one request at a time, chunks adding up to the prompt, nothing leaked at the end.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import Job, draw_jobs, pages, run_and_check

from batchserve.procs.scheduler import POLICIES, SchedulerConfig

PAGE_SIZES = (1, 2, 4, 8, 16)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Job]]:
    policy = draw(st.sampled_from(POLICIES))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    slots = draw(st.integers(1, 6))
    low_budget = slots + 1 if policy == "mixed" else 1
    budget = draw(st.integers(low_budget, low_budget + 40))
    jobs = draw_jobs(draw, arrivals=15, prompts=40, outputs=12, limits=15, cancel_within=12)
    # Capacity: at least the largest request alone (anything less is rejected up front), often tight.
    largest = max(pages(j.input_tokens + j.limit, page_size) for j in jobs)
    capacity_pages = largest + draw(st.integers(0, 3 * largest))
    capacity_tokens = capacity_pages * page_size + draw(st.integers(0, page_size - 1))  # rounded down to pages
    # recurrent_state (a hybrid model): every row must continue what its slot computed since the request's
    # (re-)admission there, which the harness checks of every row (prefix == positions written in the slot)
    config = SchedulerConfig(
        max_running_requests=slots,
        prefill_budget=budget,
        kv_capacity_tokens=capacity_tokens,
        page_size=page_size,
        policy=policy,
        fair_prefill=draw(st.booleans()),
        recurrent_state=draw(st.booleans()),
    )
    return config, jobs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_follow_the_rules_and_leak_nothing(workload: tuple[SchedulerConfig, list[Job]]) -> None:
    config, jobs = workload
    run_and_check(config, jobs)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6))
def test_mixed_with_budget_not_above_slots_is_refused(slots: int, extra: int) -> None:
    budget = max(1, slots - extra + 1)  # <= slots
    try:
        SchedulerConfig(max_running_requests=slots, prefill_budget=budget, kv_capacity_tokens=64, policy="mixed")
    except ValueError as exc:
        assert "prefill_budget > max_running_requests" in str(exc)
    else:
        raise AssertionError("mixed with prefill_budget <= max_running_requests must be refused")
