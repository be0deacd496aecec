"""Property tests: random workloads through the real scheduler, every rule and invariant checked.

`run_and_check` (tests/scheduler_harness.py) audits each ForwardBatch like a worker would and keeps
its own books of SCHEDULING.md's quantities, so the scheduler is checked against an independent
model of the rules: FIFO admission at the first step the head fits, reservation never exceeded,
KV pages owned by one request at a time, chunks adding up to the prompt, nothing leaked at the end.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from procs.scheduler import POLICIES, SchedulerConfig
from scheduler_harness import Job, pages, run_and_check

PAGE_SIZES = (1, 2, 4, 8, 16)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Job]]:
    policy = draw(st.sampled_from(POLICIES))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    slots = draw(st.integers(1, 6))
    low_budget = slots + 1 if policy == "mixed" else 1
    budget = draw(st.integers(low_budget, low_budget + 40))
    num_jobs = draw(st.integers(1, 10))
    jobs = []
    for i in range(num_jobs):
        output_tokens = draw(st.integers(1, 12))
        job = Job(
            rid=f"r{i}",
            arrival_step=draw(st.integers(0, 15)),
            input_tokens=draw(st.integers(1, 40)),
            output_tokens=output_tokens,
            max_tokens=draw(st.none() | st.integers(1, 15)),
            ignore_eos=draw(st.booleans()),
            stop_after=draw(st.none() | st.integers(1, 12)),
        )
        if draw(st.integers(0, 3)) == 0:
            job.cancel_before_step = job.arrival_step + draw(st.integers(0, 12))
        jobs.append(job)
    # Capacity: at least the largest request alone (anything less is rejected up front), often tight.
    largest = max(pages(j.input_tokens + j.limit, page_size) for j in jobs)
    capacity_pages = largest + draw(st.integers(0, 3 * largest))
    capacity_tokens = capacity_pages * page_size + draw(st.integers(0, page_size - 1))  # rounded down to pages
    config = SchedulerConfig(max_running_requests=slots, prefill_budget=budget, kv_capacity_tokens=capacity_tokens,
                             page_size=page_size, policy=policy)
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
