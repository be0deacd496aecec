"""Priority scheduling (procs/scheduler/SCHEDULING.md section 8): random scenarios with priorities
traced against the independent reading of the spec (`spec_reference.py`), equal priorities giving
exactly the fcfs traces, and the refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_reference import reference_trace
from test_scheduler_preemption import scenarios, simulate

from batchserve.procs.scheduler import POLICIES, Scheduler, SchedulerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import RequestParams, StopParams


@st.composite
def priority_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    document = draw(scenarios())
    document["config"]["scheduling_policy"] = "priority"
    for request in document["requests"]:
        request["priority"] = draw(st.integers(-2, 2))
    return document


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(priority_scenarios(), st.sampled_from(POLICIES))
def test_random_priority_scenarios_trace_like_the_independent_implementation(
    document: dict[str, Any], policy: str
) -> None:
    assert simulate(document, policy) == reference_trace(document, policy)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(POLICIES), st.integers(-3, 3))
def test_one_priority_for_everyone_is_fcfs(document: dict[str, Any], policy: str, priority: int) -> None:
    by_priority = copy.deepcopy(document)
    by_priority["config"]["scheduling_policy"] = "priority"
    for request in by_priority["requests"]:
        request["priority"] = priority
    assert simulate(by_priority, policy) == simulate(document, policy)


def test_the_worked_example_preempts_for_the_head_and_serves_the_lowest_last() -> None:
    document = json.loads((Path(__file__).resolve().parent / "scenarios" / "priority.json").read_text())
    for policy in POLICIES:
        trace = simulate(document, policy)
        admitted_last = [rid for step in trace for rid, _ in step["prefill"]][-1]
        assert admitted_last == "D", policy  # priority 2 waits for everyone, though it arrived with C
        if policy != "fixed":
            assert [rid for step in trace for rid in step.get("preempted", [])] == ["B", "A"], policy


def test_priority_needs_the_priority_policy_and_a_32_bit_value() -> None:
    config = SchedulerConfig(max_running_requests=2, prefill_budget=8, kv_capacity_tokens=64)
    stop = StopParams(max_tokens=4)
    with pytest.raises(Refusal, match="--scheduling-policy priority") as fcfs:
        Scheduler(config).add_request("a", [5, 6], RequestParams(stop=stop, priority=1))
    assert fcfs.value.param == "priority" and fcfs.value.status == 400
    Scheduler(config).add_request("a", [5, 6], RequestParams(stop=stop, priority=0))
    prio = Scheduler(
        SchedulerConfig(max_running_requests=2, prefill_budget=8, kv_capacity_tokens=64, scheduling_policy="priority")
    )
    with pytest.raises(Refusal, match="32-bit") as big:
        prio.add_request("a", [5, 6], RequestParams(stop=stop, priority=2**31))
    assert big.value.param == "priority"
    prio.add_request("a", [5, 6], RequestParams(stop=stop, priority=-(2**31)))
