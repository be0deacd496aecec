"""The prefix cache in the scheduler: a radix tree over full KV pages, shared by reference count.

The strongest check is `KVContentExecutor` (tests/scheduler_harness.py): a fake worker that remembers, for
every KV position of the pool, which token at which position was written there, and before every step
verifies that each request's whole context (through its page table, shared pages included) holds exactly its
own tokens. Random workloads with shared prefixes, tight pools, preemption and cancels run through it while
the tree's reference counts are audited against the requests that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS, KVContentExecutor, audit_references

from batchserve.procs.scheduler import POLICIES, Scheduler, SchedulerConfig
from batchserve.procs.scheduler.prefix_cache import PrefixCache
from batchserve.shared.messages import RequestParams, StopParams

# ------------------------------------------------------------------ the tree on its own


def _ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_match_insert_reference_and_lru_eviction_of_leaves():
    cache = PrefixCache(page_size=2)
    tokens = _ids(1, 2, 3, 4, 5, 6, 7)
    assert cache.match(tokens, 3) == []
    keys = cache.page_keys(tokens, 0, 3)
    a, new_a = cache.insert(cache.root(), keys[0], page=10)
    b, new_b = cache.insert(a, keys[1], page=11)
    c, _ = cache.insert(b, keys[2], page=12)
    assert new_a and new_b and cache.num_pages == 3
    assert cache.insert(a, keys[1], page=99) == (b, False)  # already there: 99 stays with its owner
    assert [n.page for n in cache.match(tokens, 3)] == [10, 11, 12]
    assert [n.page for n in cache.match(tokens, 2)] == [10, 11]  # at most max_pages
    assert [n.page for n in cache.match(_ids(1, 2, 3, 9, 5, 6), 3)] == [10]  # diverges in page 2

    other, _ = cache.insert(a, cache.page_keys(_ids(0, 0, 8, 8), 1, 2)[0], page=13)  # a second branch
    cache.reference([a, b, c])
    cache.reference([a, other])
    assert cache.num_referenced == 4 and cache.num_evictable == 0
    assert cache.evict(4).tolist() == []  # everything in use
    cache.dereference([a, other])  # `other` is the least recently used leaf
    cache.dereference([a, b, c])
    assert cache.num_referenced == 0
    assert cache.evict(1).tolist() == [13]
    assert cache.evict(5).tolist() == [12, 11, 10]  # leaves first: c, then b, then a
    assert cache.num_pages == 0 and cache.match(tokens, 3) == []


def test_state_snapshots_serve_the_deepest_kept_node_least_recently_used_out_first():
    """A hybrid model's cache: a match stops at the deepest node whose state a snapshot keeps; with every
    snapshot held, a new one takes the least recently used node's; evicting a node frees its snapshot."""
    cache = PrefixCache(page_size=2, state_snapshots=2)
    snapshots = cache.snapshots
    tokens = _ids(1, 2, 3, 4, 5, 6, 7)
    keys = cache.page_keys(tokens, 0, 3)
    a, _ = cache.insert(cache.root(), keys[0], page=10)
    b, _ = cache.insert(a, keys[1], page=11)
    c, _ = cache.insert(b, keys[2], page=12)

    def served(pages: int):
        return cache.with_state(cache.match(tokens, pages))

    assert cache.match(tokens, 3) == [a, b, c] and served(3) == []  # full-layer KV alone never serves
    assert snapshots.take(a) == 0 and snapshots.take(c) == 1
    assert served(3) == [a, b, c] and served(2) == [a]  # b keeps no state
    served(2)  # a used last: c is the least recently used
    assert snapshots.take(b) == 1 and (c.state, b.state) == (-1, 1)
    assert served(3) == [a, b]
    cache.reference([a, b, c])
    cache.dereference([a, b, c])
    assert cache.evict(3).tolist() == [12, 11, 10]  # unreferenced: c, b, a go, and their snapshots with them
    assert cache.num_pages == 0 and sorted(snapshots._free) == [0, 1]


@dataclass
class Job:
    rid: str
    arrival: int
    prompt: list[int]
    outputs: int
    cancel_before: int | None = None


def run(config: SchedulerConfig, jobs: list[Job], max_steps: int = 4000) -> tuple[Scheduler, KVContentExecutor]:
    sched = Scheduler(config, eos_token_ids=(EOS,))
    ex = KVContentExecutor(sched, {j.rid: j.prompt for j in jobs}, {j.rid: j.outputs for j in jobs})
    ended: set[str] = set()
    for step in range(max_steps):
        for job in jobs:
            if job.arrival == step:
                sched.add_request(job.rid, job.prompt, RequestParams(stop=StopParams(max_tokens=job.outputs)))
            if job.cancel_before == step and job.arrival <= step and sched.abort(job.rid):
                ended.add(job.rid)
        if len(ended) == len(jobs) and step > max(j.arrival for j in jobs) and not sched.has_unfinished():
            break
        out = sched.step(ex)
        for rid in out.finished:
            ended.add(rid)
            assert ex.sampled[rid] == [ex.token(rid, k) for k in range(ex.outputs[rid])], f"{rid}: tokens lost"
        assert sched.kv_used_tokens <= sched.kv_capacity_tokens
        audit_references(sched)
    else:
        raise AssertionError("not done")
    assert sched.num_running == sched.num_waiting == 0 and sched.kv.cache.num_referenced == 0
    assert sched.allocator.num_free + sched.kv.cache.num_pages == sched.num_kv_pages
    sched.allocator.free(sched.kv.cache.evict(sched.num_kv_pages))
    assert sched.allocator.num_free == sched.num_kv_pages
    return sched, ex


@st.composite
def shared_prefix_workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Job]]:
    page_size = draw(st.sampled_from((1, 2, 4, 16)))
    policy = draw(st.sampled_from(POLICIES))
    slots = draw(st.integers(1, 6))
    bases = [
        [draw(st.integers(3, 60)) for _ in range(draw(st.integers(0, 40)))] for _ in range(draw(st.integers(1, 3)))
    ]
    jobs = []
    for i in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(bases)) + [draw(st.integers(3, 60)) for _ in range(draw(st.integers(1, 12)))]
        job = Job(f"r{i}", draw(st.integers(0, 12)), prompt, draw(st.integers(1, 20)))
        if draw(st.integers(0, 4)) == 0:
            job.cancel_before = job.arrival + draw(st.integers(0, 25))
        jobs.append(job)
    largest = max(-(-(len(j.prompt) + j.outputs) // page_size) for j in jobs)
    config = SchedulerConfig(
        max_running_requests=slots,
        prefill_budget=draw(st.integers(slots + 1, slots + 30)),
        kv_capacity_tokens=(largest + draw(st.integers(0, 2 * largest))) * page_size,
        page_size=page_size,
        policy=policy,
        prefix_cache=True,
        kv_reserve_ratio=draw(st.sampled_from([1.0, 0.5, 0.1, 0.01])),
        # a hybrid model's: a cached prefix serves only from a snapshot of its state
        # (KVContentExecutor checks each slot's state against its request's context)
        **draw(st.sampled_from([{}, dict(recurrent_state=True, state_snapshots=2)])),
    )
    return config, jobs


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_shared_prefixes_keep_every_kv_position_right_and_references_exact(workload):
    run(*workload)


def test_a_later_request_starts_after_the_cached_prefix_and_reads_pages_it_did_not_write():
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=64, kv_capacity_tokens=64, page_size=4, prefix_cache=True
    )
    system = list(range(10, 22))  # 12 tokens: 3 full pages
    first, second = Job("A", 0, system + [5, 6], 3), Job("B", 6, system + [7], 2)
    sched, ex = run(config, [first, second])
    assert sched.kv.hit_tokens == 12 and sched.kv.queried_tokens == 14 + 13


def test_a_whole_prompt_in_the_cache_still_computes_its_last_token():
    config = SchedulerConfig(
        max_running_requests=1, prefill_budget=64, kv_capacity_tokens=64, page_size=4, prefix_cache=True
    )
    prompt = list(range(10, 18))  # exactly 2 pages
    sched = Scheduler(config, eos_token_ids=(EOS,))
    ex = KVContentExecutor(sched, {"A": prompt, "B": prompt}, {"A": 2, "B": 2})
    sched.add_request("A", prompt, RequestParams(stop=StopParams(max_tokens=2)))
    while sched.has_unfinished():
        sched.step(ex)
    sched.add_request("B", prompt, RequestParams(stop=StopParams(max_tokens=2)))
    out = sched.step(ex)
    assert out.prefill == [("B", 4)]  # page 0 cached; page 1 holds the last token, computed again
    assert [(d.rid, d.cached_tokens) for d in sched.token_deltas(out)] == [("B", 4)]


def test_an_abort_mid_prefill_caches_only_completed_pages():
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=6, kv_capacity_tokens=64, page_size=4, prefix_cache=True
    )
    sched = Scheduler(config, eos_token_ids=(EOS,))
    prompt = list(range(10, 30))  # 20 tokens, chunks of 6
    ex = KVContentExecutor(sched, {"A": prompt}, {"A": 5})
    sched.add_request("A", prompt, RequestParams(stop=StopParams(max_tokens=5)))
    sched.step(ex)
    sched.step(ex)  # 12 prefilled: pages 0-2 complete
    assert sched.abort("A")
    cache = sched.kv.cache
    assert cache.num_pages == 3 and cache.num_referenced == 0  # cached, referenced by nobody
    assert sched.allocator.num_free + 3 == sched.num_kv_pages


def test_disconnect_storm_leaves_no_referenced_page():
    config = SchedulerConfig(
        max_running_requests=8,
        prefill_budget=16,
        kv_capacity_tokens=512,
        page_size=4,
        prefix_cache=True,
        policy="mixed",
    )
    system = list(range(10, 30))
    jobs = [Job(f"r{i}", i % 3, system + [40 + i], 30, cancel_before=2 + i) for i in range(12)]
    sched, _ = run(config, jobs)
    assert sched.kv.hit_tokens > 0


def test_with_nothing_to_share_the_cache_changes_no_trace():
    """Scenario prompts share nothing unless they say so: with the cache on (and filling and evicting),
    every hand-derived trace of the scenarios without shared prefixes is unchanged. (Not with
    preemption: a recompute finds its own earlier pages, see the next test.)"""
    from pathlib import Path

    import msgspec

    from batchserve.procs.scheduler.simulate import (
        load_scenario,
        run_scenario,
        scenario_scheduler,
        scheduler_config_from_scenario,
        trace_record,
    )

    def normal(trace: list[dict]) -> list[dict]:
        return [{**s, "finished": sorted(s["finished"]), "cancelled": sorted(s["cancelled"])} for s in trace]

    for path in sorted((Path(__file__).parent / "scenarios").glob("*.json")):
        scenario = load_scenario(path)
        preempts = any("preempted" in step for trace in scenario.expected.values() for step in trace)
        if (
            any(r.shared_prefix for r in scenario.requests)
            or preempts
            or scenario.config.sliding_window
            or scenario.config.pooling
        ):
            continue  # (a sliding window gives pages back, pooling needs every token: no prefix cache with them)
        for policy, expected in scenario.expected.items():
            config = msgspec.structs.replace(scheduler_config_from_scenario(scenario, policy), prefix_cache=True)
            sched = scenario_scheduler(scenario, config)  # the scenario's scripted drafts, if any
            trace = [trace_record(out) for out in run_scenario(scenario, config, scheduler=sched)]
            assert normal(trace) == normal(expected), (path.name, policy)
            assert sched.kv.hit_tokens == 0 and sched.kv.cache.num_referenced == 0


def test_a_recompute_after_preemption_mostly_hits_the_cache():
    """The preemption scenario with the cache on: B's 11-token recompute finds the 8 of its pages that
    A's growth did not evict (LRU takes B's last two first), so it prefills 3 tokens instead of 8 + 3."""
    from pathlib import Path

    import msgspec

    from batchserve.procs.scheduler.simulate import (
        load_scenario,
        run_scenario,
        scheduler_config_from_scenario,
        trace_record,
    )

    scenario = load_scenario(Path(__file__).parent / "scenarios" / "preemption.json")
    config = msgspec.structs.replace(scheduler_config_from_scenario(scenario, "prefill-first"), prefix_cache=True)
    trace = [trace_record(out) for out in run_scenario(scenario, config)]
    assert trace[8]["preempted"] == ["B"] and trace[10]["prefill"] == [["B", 3]]
    assert trace[11] == {"step": 11, "prefill": [], "decode": ["B"], "finished": ["B"], "cancelled": []}


@pytest.mark.parametrize("page_size", [1, 4])
def test_preempted_requests_recompute_from_the_cache(page_size):
    config = SchedulerConfig(
        max_running_requests=3,
        prefill_budget=64,
        kv_capacity_tokens=48,
        page_size=page_size,
        prefix_cache=True,
        kv_reserve_ratio=0.05,
    )
    jobs = [Job(f"r{i}", 0, list(range(10 + i, 22 + i)), 20) for i in range(3)]
    sched, _ = run(config, jobs)
    assert sched.kv.hit_tokens > 0  # the recomputes found their own earlier pages


@pytest.mark.parametrize("speculative, cached_pages", [("off", 2), ("draft", 1)])
def test_with_a_draft_model_a_released_request_leaves_its_last_kv_token_out(speculative, cached_pages):
    """A draft model is fed the last token of a row accepted whole only with the request's next row, so a
    request released after such a row has that position's target KV but not the draft's: its page stays
    out of the cache (a later request would read the draft KV there as written)."""
    config = SchedulerConfig(
        max_running_requests=1,
        prefill_budget=64,
        kv_capacity_tokens=64,
        page_size=4,
        prefix_cache=True,
        speculative=speculative,
    )
    prompt = list(range(10, 16))  # 6 tokens; 3 outputs leave KV for 8 positions: 2 full pages
    sched = Scheduler(config, eos_token_ids=(EOS,))
    ex = KVContentExecutor(sched, {"A": prompt}, {"A": 3})
    sched.add_request("A", prompt, RequestParams(stop=StopParams(max_tokens=3)))
    while sched.has_unfinished():
        sched.step(ex)
    assert ex.sampled["A"] == [ex.token("A", k) for k in range(3)]
    assert sched.kv.cache.num_pages == cached_pages
