"""The scheduler with a sliding window (SCHEDULING.md 5): on random workloads, every request's pages
wholly before its window go back to the pool as it moves on; while a step runs, a decoding request holds
at most a window and a page, a prefilling one that and its chunk; the KV a step attends to (its window)
is always the request's own tokens, read through the page table the worker is sent; every request
finishes, and the pool ends empty. And what it buys: more requests at once in the same pool."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS, FIRST_TOKEN, pages

from batchserve.procs.scheduler import Scheduler, SchedulerConfig
from batchserve.shared.messages import ForwardBatch, RequestParams, StepResult, StopParams


class WindowExecutor:
    """Plays the worker: applies the batch's page-table updates (dropped columns become page 0), writes
    each token's KV, and checks that every position a token attends to (the last `window`) is its own."""

    def __init__(self, sched: Scheduler, prompts: dict[str, list[int]], window: int) -> None:
        self.sched, self.prompts, self.window, self.P = sched, prompts, window, sched.page_size
        self.page_table: dict[tuple[int, int], int] = {}
        self.kv: dict[int, tuple[int, int]] = {}
        self.sampled: dict[str, list[int]] = {}

    def execute(self, batch: ForwardBatch) -> StepResult:
        for slot, col, page in zip(
            batch.page_table_slots.tolist(), batch.page_table_cols.tolist(), batch.page_table_pages.tolist()
        ):
            self.page_table[(slot, col)] = page
        out, offset = [], 0
        for i, slot in enumerate(batch.slots):
            rid = self.sched.rid_in_slot(slot)
            sampled = self.sampled.setdefault(rid, [])
            seq = self.prompts[rid] + sampled
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            t = self.sched.table
            held, limit = int(t.num_pages[slot] - t.dropped_pages[slot]), pages(self.window + self.P + e - 1, self.P)
            assert held <= limit, f"{rid} holds {held} pages while feeding {e} tokens at {p}, more than {limit}"
            for q, loc in zip(range(p, p + e), batch.kv_locs[offset : offset + e].tolist()):
                self.kv[loc] = (seq[q], q)
            for q in range(max(0, p - self.window + 1), p):  # the window of the step's first token
                page = self.page_table[(slot, q // self.P)]
                assert page > 0, f"{rid}: position {q}, inside the window, lies in a dropped page"
                assert self.kv.get(page * self.P + q % self.P) == (seq[q], q), f"{rid}: KV at {q} is not its own"
            offset += e
            if batch.sample_lens[i]:
                token = FIRST_TOKEN + len(sampled)
                sampled.append(token)
                out.append(token)
        return StepResult(step=batch.step, next_token_ids=np.asarray(out, dtype=np.int32))


def check_held_pages(sched: Scheduler) -> None:
    """The pool's used pages are exactly the admitted requests' own, dropped ones left out."""
    t = sched.table
    admitted = t.admit_seq >= 0
    assert int((t.num_pages[admitted] - t.dropped_pages[admitted]).sum()) == sched.allocator.num_used


def run(config: SchedulerConfig, jobs: list[tuple[int, int, int]]) -> tuple[int, int]:
    """jobs: (arrival step, prompt tokens, output tokens); returns the most running at once and the preemptions."""
    sched = Scheduler(config, eos_token_ids=(EOS,))
    prompts = {f"r{i}": list(range(3 + 50 * i, 3 + 50 * i + n)) for i, (_, n, _) in enumerate(jobs)}
    executor = WindowExecutor(sched, prompts, config.sliding_window or 10**9)
    most = preempted = 0
    for step in range(2000):
        for i, (arrival, _, outputs) in enumerate(jobs):
            if arrival == step:
                sched.add_request(
                    f"r{i}", prompts[f"r{i}"], RequestParams(stop=StopParams(max_tokens=outputs, ignore_eos=True))
                )
        if step > max(a for a, _, _ in jobs) and not sched.has_unfinished():
            break
        preempted += len(sched.step(executor).preempted)
        most = max(most, sched.num_running)
        check_held_pages(sched)
    assert not sched.has_unfinished() and sched.allocator.num_used == 0
    assert all(len(executor.sampled[f"r{i}"]) == outputs for i, (_, _, outputs) in enumerate(jobs))
    return most, preempted


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 12),
    page_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(5, 16),
    policy=st.sampled_from(["prefill-first", "mixed", "fixed"]),
    ratio=st.sampled_from([0.05, 0.5, 1.0]),
    jobs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=8),
)
def test_pages_out_of_the_window_go_back(window, page_size, budget, policy, ratio, jobs):
    config = SchedulerConfig(
        max_running_requests=4,
        prefill_budget=budget,
        kv_capacity_tokens=160,
        page_size=page_size,
        policy=policy,
        kv_reserve_ratio=ratio,
        sliding_window=window,
    )
    run(config, jobs)


def test_a_window_runs_more_requests_at_once():
    """16 requests of 60 prompt and 40 output tokens in a pool of 256: a window of 16 runs them all at
    once (each holds at most 16 + 4 tokens once its prompt is in); without one, two fit."""
    jobs = [(0, 60, 40)] * 16
    base = dict(max_running_requests=16, prefill_budget=64, kv_capacity_tokens=256, page_size=4)
    windowed, _ = run(SchedulerConfig(**base, sliding_window=16), jobs)
    full, _ = run(SchedulerConfig(**base), jobs)
    assert windowed >= 3 * full, (windowed, full)


def test_windowed_requests_are_preempted_and_recomputed():
    """Short prompts, long outputs, a 5 % estimate: the running requests outgrow the pool before their
    windows cap them, the newest is preempted and recomputed (its window's KV checked again)."""
    config = SchedulerConfig(
        max_running_requests=4,
        prefill_budget=8,
        kv_capacity_tokens=24,
        page_size=2,
        kv_reserve_ratio=0.05,
        sliding_window=8,
        max_context=64,
    )
    _, preempted = run(config, [(0, 2, 30)] * 6)
    assert preempted > 0


def test_a_request_a_recompute_could_not_fit_is_refused_on_arrival():
    """With a window, a recompute's prompt holds the generated tokens: at arrival the worst case over any
    recompute must fit the pool, or the request would wait forever (and the queue behind it)."""
    import pytest

    from batchserve.shared.errors import Refusal

    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=64, kv_capacity_tokens=32, page_size=4, sliding_window=8, max_context=128
    )
    sched = Scheduler(config, eos_token_ids=(EOS,))
    with pytest.raises(Refusal, match="can never fit"):
        sched.add_request("long", [5] * 4, RequestParams(stop=StopParams(max_tokens=100)))
    sched.add_request("short", [5] * 4, RequestParams(stop=StopParams(max_tokens=8)))  # 12 tokens: fits
