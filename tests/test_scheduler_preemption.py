"""Estimated reservation and preemption (procs/scheduler/SCHEDULING.md, `kv_reserve_ratio` < 1).

Three kinds of checks: random scenarios against an independent implementation of the spec
(`spec_reference.py`, which must first reproduce every hand-derived trace), random workloads through
the auditing fake worker (KV never over capacity, nothing leaked, every scripted token exactly once),
and the ForwardBatches of a recompute seen up close.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS, FIRST_TOKEN, Job, draw_jobs, pages, run_and_check
from spec_reference import reference_trace

from batchserve.procs.scheduler import POLICIES, Scheduler, SchedulerConfig, SchedulerConfigError
from batchserve.procs.scheduler.simulate import Scenario, run_scenario, scheduler_config_from_scenario, trace_record
from batchserve.shared.messages import ForwardBatch, RequestParams, SamplingParams, StepResult, StopParams

# The reference counts token positions: the scenarios with page size 1 (all but paged_admission and
# sliding_window); it reads sections 1-5, 8, 9 and 10, not the step-time bound of 6.5 (step_time_cap) nor
# section 5's rope switch (rope_switch).
SCENARIOS = [
    p
    for p in sorted((Path(__file__).resolve().parent / "scenarios").glob("*.json"))
    if json.loads(p.read_text())["config"].get("page_size", 1) == 1
    and not json.loads(p.read_text())["config"].get("max_step_ms")
    and not json.loads(p.read_text())["config"].get("rope_switch_length")
]


def simulate(document: dict[str, Any], policy: str) -> list[dict[str, Any]]:
    scenario = msgspec.convert(document, Scenario)
    return [trace_record(out) for out in run_scenario(scenario, scheduler_config_from_scenario(scenario, policy))]


def _sorted_lists(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**s, "finished": sorted(s["finished"]), "cancelled": sorted(s["cancelled"])} for s in trace]


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_the_reference_reproduces_every_hand_derived_trace(path: Path) -> None:
    document = json.loads(path.read_text())
    for policy, expected in document["expected"].items():
        assert _sorted_lists(reference_trace(document, policy)) == _sorted_lists(expected), policy


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Often tight: outputs longer than prompts, a pool little above the largest request, small rho."""
    slots = draw(st.integers(1, 5))
    requests = []
    for i in range(draw(st.integers(1, 8))):
        requests.append(
            {
                "id": f"r{i}",
                "arrival_step": draw(st.integers(0, 8)),
                "input_tokens": draw(st.integers(1, 12)),
                "output_tokens": draw(st.integers(1, 24)),
                "max_tokens": draw(st.none() | st.integers(1, 28)),
            }
        )
    cancels = [
        {"id": r["id"], "before_step": r["arrival_step"] + draw(st.integers(0, 25))}
        for r in requests
        if draw(st.integers(0, 4)) == 0
    ]
    largest = max(r["input_tokens"] + (r["max_tokens"] or r["output_tokens"]) for r in requests)
    return {
        "config": {
            "max_running_requests": slots,
            "prefill_budget": draw(st.integers(slots + 1, slots + 24)),
            "kv_capacity_tokens": largest + draw(st.integers(0, largest)),
            "kv_reserve_ratio": draw(st.sampled_from([1.0, 0.5, 0.25, 0.1, 0.05, 0.01])),
            "fair_prefill": draw(st.booleans()),
        },
        "requests": requests,
        "cancels": cancels,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(POLICIES))
def test_random_scenarios_trace_like_the_independent_implementation(document: dict[str, Any], policy: str) -> None:
    assert simulate(document, policy) == reference_trace(document, policy)


@st.composite
def pooling_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """The pooling runner's (section 11): prefill-only requests, a decoder's chunked or an encoder's whole."""
    slots, whole = draw(st.integers(1, 5)), draw(st.booleans())
    requests = [
        {
            "id": f"r{i}",
            "arrival_step": draw(st.integers(0, 6)),
            "input_tokens": draw(st.integers(1, 20)),
            "output_tokens": 1,
        }
        for i in range(draw(st.integers(1, 8)))
    ]
    cancels = [
        {"id": r["id"], "before_step": r["arrival_step"] + draw(st.integers(0, 6))}
        for r in requests
        if draw(st.integers(0, 4)) == 0
    ]
    largest = max(r["input_tokens"] for r in requests)
    budget = draw(st.integers(max(slots + 1, largest if whole else 1), slots + 24))
    return {
        "config": {
            "max_running_requests": slots,
            "prefill_budget": budget,
            "pooling": True,
            "whole_prompts": whole,
            "kv_capacity_tokens": largest + draw(st.integers(0, 2 * largest)),
            "fair_prefill": draw(st.booleans()),
        },
        "requests": requests,
        "cancels": cancels,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pooling_scenarios(), st.sampled_from(POLICIES))
def test_random_pooling_scenarios_trace_like_the_independent_implementation(
    document: dict[str, Any], policy: str
) -> None:
    assert simulate(document, policy) == reference_trace(document, policy)


def test_random_scenarios_do_preempt() -> None:
    """The comparison above is only worth something if its scenarios preempt: they do, often."""
    document = {
        "config": {"max_running_requests": 4, "prefill_budget": 16, "kv_capacity_tokens": 40, "kv_reserve_ratio": 0.1},
        "requests": [{"id": f"r{i}", "arrival_step": i, "input_tokens": 5, "output_tokens": 12} for i in range(6)],
    }
    for policy in POLICIES:
        trace = simulate(document, policy)
        assert sum(len(s.get("preempted", [])) for s in trace) >= 2, policy
        assert trace == reference_trace(document, policy)


@st.composite
def tight_workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Job]]:
    policy = draw(st.sampled_from(POLICIES))
    page_size = draw(st.sampled_from((1, 2, 4, 16)))
    slots = draw(st.integers(1, 6))
    jobs = draw_jobs(draw, arrivals=8, prompts=20, outputs=40, limits=40, cancel_within=40)
    largest = max(pages(j.input_tokens + j.limit, page_size) for j in jobs)
    capacity_pages = largest + draw(st.integers(0, largest // 2 + 1))  # tight: a few requests at most
    config = SchedulerConfig(
        max_running_requests=slots,
        prefill_budget=draw(st.integers(slots + 1, slots + 40)),
        kv_capacity_tokens=capacity_pages * page_size,
        page_size=page_size,
        policy=policy,
        kv_reserve_ratio=draw(st.integers(1, 60)) / 100,
    )
    return config, jobs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_workloads())
def test_tight_kv_with_estimates_preempts_and_loses_nothing(workload: tuple[SchedulerConfig, list[Job]]) -> None:
    config, jobs = workload
    run_and_check(config, jobs)


def test_a_preempted_request_recomputes_its_tokens_and_continues_its_count() -> None:
    """Two requests outgrow a 12-token pool; B (admitted last) is preempted and prefilled again with
    its prompt followed by the tokens it had, and its next sample continues its count."""
    sched = Scheduler(
        SchedulerConfig(
            max_running_requests=2,
            prefill_budget=16,
            kv_capacity_tokens=12,
            kv_reserve_ratio=0.1,
            policy="prefill-first",
        ),
        eos_token_ids=(EOS,),
    )
    seeded = SamplingParams(temperature=0.7, seed=11)
    sched.add_request("A", [3, 4], RequestParams(sampling=seeded, stop=StopParams(max_tokens=6)))
    sched.add_request("B", [5, 6, 7], RequestParams(sampling=seeded, stop=StopParams(max_tokens=6)))
    batches: list[ForwardBatch] = []

    class Counting:
        def execute(self, batch: ForwardBatch) -> StepResult:
            batches.append(batch)
            ids = [FIRST_TOKEN + c + j for c, n in zip(batch.sample_counts, batch.sample_lens) for j in range(n)]
            return StepResult(step=batch.step, next_token_ids=np.asarray(ids, dtype=np.int32))

    outs = []
    while sched.has_unfinished():
        outs.append(sched.step(Counting()))
        assert sched.kv_used_tokens <= 12
    preempting = [o for o in outs if o.preempted]
    assert [o.preempted for o in preempting] == [["B"]]
    recompute = next(b for b in batches if b.step > preempting[0].step and b.prefix_lens == [0])
    generated_before = sum(1 for o in outs[: preempting[0].step] for rid, _ in o.new_tokens if rid == "B")
    assert recompute.input_ids.tolist() == [5, 6, 7] + [FIRST_TOKEN + k for k in range(generated_before)]
    assert recompute.sample_counts == [generated_before] and recompute.sample_lens == [1]
    tokens = {rid: [t for o in outs for r, t in o.new_tokens if r == rid] for rid in "AB"}
    assert tokens == {rid: [FIRST_TOKEN + k for k in range(6)] for rid in "AB"}
    assert sched.allocator.num_free == 12 and sched.num_running == sched.num_waiting == 0


def test_aborting_a_preempted_request_while_it_waits_frees_nothing_twice() -> None:
    sched = Scheduler(
        SchedulerConfig(max_running_requests=2, prefill_budget=16, kv_capacity_tokens=10, kv_reserve_ratio=0.01),
        eos_token_ids=(EOS,),
    )
    for rid in "AB":
        sched.add_request(rid, [3, 4], RequestParams(stop=StopParams(max_tokens=8, ignore_eos=True)))
    ex = _Echo()
    while not sched.step(ex).preempted:
        pass
    assert sched.num_waiting == 1 and sched.abort("B")
    assert sched.num_waiting == 0 and sched.step(ex).cancelled == ["B"]
    while sched.has_unfinished():
        sched.step(ex)
    assert sched.allocator.num_free == 10 and sched.kv.reserved_pages() * sched.page_size == 0


def test_preempted_requests_wait_ahead_of_new_ones_in_first_admission_order() -> None:
    sched = Scheduler(
        SchedulerConfig(
            max_running_requests=3, prefill_budget=30, kv_capacity_tokens=16, kv_reserve_ratio=0.01, policy="mixed"
        ),
        eos_token_ids=(EOS,),
    )
    for rid in "ABC":
        sched.add_request(rid, [3, 4], RequestParams(stop=StopParams(max_tokens=12, ignore_eos=True)))
    ex = _Echo()
    preempted: list[str] = []
    while len(preempted) < 2:
        preempted += sched.step(ex).preempted
    assert preempted == ["C", "B"]
    sched.add_request("D", [3], RequestParams(stop=StopParams(max_tokens=2)))
    assert [r.rid for r in sched.prefill_manager.pending_list] == ["B", "C", "D"]


def test_the_ratio_must_be_whole_percents_in_0_1() -> None:
    base = {"max_running_requests": 2, "prefill_budget": 8, "kv_capacity_tokens": 64}
    for bad in (0.0, -0.1, 1.01, 0.123):
        with pytest.raises(SchedulerConfigError, match="kv_reserve_ratio"):
            SchedulerConfig(**base, kv_reserve_ratio=bad)
    assert SchedulerConfig(**base, kv_reserve_ratio=0.07).kv_reserve_percent == 7
    assert SchedulerConfig(**base).kv_reserve_percent == 100


class _Echo:
    """Answers FIRST_TOKEN + count for every sampling row (never EOS)."""

    def execute(self, batch: ForwardBatch) -> StepResult:
        ids = [FIRST_TOKEN + c + j for c, n in zip(batch.sample_counts, batch.sample_lens) for j in range(n)]
        return StepResult(step=batch.step, next_token_ids=np.asarray(ids, dtype=np.int32))
