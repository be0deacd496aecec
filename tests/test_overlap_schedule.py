"""Overlap scheduling: step N+1 is launched before step N's tokens are back (`Scheduler.launch` /
`Scheduler.complete`), as the scheduler process runs it.

The driver here launches ahead like the process does and runs each batch one step late on
`KVContentExecutor`, which checks every KV position and feeds `FUTURE_TOKEN` inputs the slot's last
sampled token as the worker does. Every request must still get exactly its scripted tokens and its
finish reason, whatever the policy, the prefix cache, preemption (which drains the pipeline first) and
cancels; at the end nothing may be left held.
"""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS, FIRST_TOKEN, Job, KVContentExecutor, audit_references, draw_jobs, pages

from batchserve.procs.scheduler import POLICIES, LaunchedStep, Scheduler, SchedulerConfig, StepOutput
from batchserve.shared.messages import FUTURE_TOKEN, RequestParams, SamplingParams, StepResult


class OverlappedDriver:
    """Launches up to `depth` steps ahead and completes them in order, as `SchedulerLoop.run` does."""

    def __init__(self, sched: Scheduler, execute, depth: int = 2) -> None:
        self.sched, self.execute, self.depth = sched, execute, depth
        self.in_flight: deque[tuple[LaunchedStep, list[str]]] = deque()
        self.outputs: list[StepOutput] = []
        self.drains = 0

    def turn(self) -> LaunchedStep:
        launched = self.sched.launch(drain=self.drain)
        if launched.batch is None:
            self.outputs.append(launched.out)
        else:
            # The worker knows a slot's request from what the batch set up when it was launched.
            owners = [self.sched.rid_in_slot(s) for s in launched.batch.slots]
            self.in_flight.append((launched, owners))
        if self.in_flight and (len(self.in_flight) >= self.depth or launched.batch is None):
            self.complete_oldest()
        return launched

    def complete_oldest(self) -> None:
        launched, owners = self.in_flight.popleft()
        self.outputs.append(self.sched.complete(launched, self.execute(launched.batch, owners)))

    def drain(self) -> None:
        self.drains += 1
        while self.in_flight:
            self.complete_oldest()


def run_overlapped(
    config: SchedulerConfig, jobs: list[Job], max_turns: int = 5000, priorities: dict[str, int] | None = None
) -> OverlappedDriver:
    sched = Scheduler(config, eos_token_ids=(EOS,))
    ex = KVContentExecutor(sched, {j.rid: j.prompt() for j in jobs}, {j.rid: j.output_tokens for j in jobs})
    limits = {j.rid: j.limit for j in jobs}

    def execute(batch, owners: list[str]) -> StepResult:
        for owner, n, count in zip(owners, batch.sample_lens, batch.sample_counts):
            assert count + n <= limits[owner], f"{owner}: launched past its max_tokens"
        return ex.execute(batch, owners)

    driver = OverlappedDriver(sched, execute)
    cancelled: set[str] = set()
    for turn in range(max_turns):
        for job in jobs:
            if job.arrival_step == turn:
                sched.add_request(
                    job.rid,
                    job.prompt(),
                    RequestParams(stop=job.stop_params(), priority=(priorities or {}).get(job.rid, 0)),
                )
            if job.cancel_before_step == turn and job.arrival_step <= turn and sched.abort(job.rid):
                cancelled.add(job.rid)
        if turn > max(j.arrival_step for j in jobs) and not sched.has_unfinished() and not driver.in_flight:
            break
        driver.turn()
        assert sched.kv_used_tokens <= sched.kv_capacity_tokens
        if config.prefix_cache:
            audit_references(sched)
    else:
        raise AssertionError("not done")

    delivered: dict[str, list[int]] = {j.rid: [] for j in jobs}
    ends: dict[str, str] = {}
    for out in driver.outputs:
        for rid, token in out.new_tokens:
            assert rid not in ends, f"{rid}: a token after its end"
            delivered[rid].append(token)
        for rid in out.finished:
            ends[rid] = out.finish_reasons[rid]
        for rid in out.cancelled:
            assert rid not in ends
            ends[rid] = "abort"
    for job in jobs:
        scripted = [job.scripted(k) for k in range(len(delivered[job.rid]))]
        assert delivered[job.rid] == scripted, f"{job.rid}: tokens lost, repeated or out of order"
        if job.rid not in cancelled:
            n, reason = job.expected_end()
            assert (len(delivered[job.rid]), ends[job.rid]) == (n, reason), job.rid
        else:
            assert job.rid in ends
    # Nothing held: no slot, no reserved or used KV, every page free or in the cache unreferenced.
    assert sched.num_running == sched.num_waiting == 0 and sched.kv.reserved_pages() * sched.page_size == 0
    cached = sched.kv.cache.num_pages if sched.kv.cache is not None else 0
    assert sched.allocator.num_free + cached == sched.num_kv_pages
    assert sched.kv.cache is None or sched.kv.cache.num_referenced == 0
    return driver


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Job]]:
    policy = draw(st.sampled_from(POLICIES))
    page_size = draw(st.sampled_from((1, 2, 4, 16)))
    slots = draw(st.integers(1, 6))
    jobs = draw_jobs(draw, arrivals=15, prompts=40, outputs=12, limits=15, cancel_within=12)
    largest = max(pages(j.input_tokens + j.limit, page_size) for j in jobs)
    config = SchedulerConfig(
        max_running_requests=slots,
        prefill_budget=draw(st.integers(slots + 1, slots + 40)),
        kv_capacity_tokens=(largest + draw(st.integers(0, 3 * largest))) * page_size,
        page_size=page_size,
        policy=policy,
        prefix_cache=draw(st.booleans()),
        fair_prefill=draw(st.booleans()),
        kv_reserve_ratio=draw(st.sampled_from([1.0, 0.5, 0.1, 0.01])),
    )
    return config, jobs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_launching_ahead_gives_every_request_its_tokens_and_leaks_nothing(workload) -> None:
    run_overlapped(*workload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_priority_preemptions_drain_the_pipeline_and_lose_nothing(workload, data) -> None:
    """Under the priority policy the queue's head preempts lower priorities (SCHEDULING.md section 8),
    which with steps in flight drains them first."""
    config, jobs = workload
    config = msgspec.structs.replace(config, scheduling_policy="priority")
    priorities = {j.rid: data.draw(st.integers(-2, 2)) for j in jobs}
    run_overlapped(config, jobs, priorities=priorities)


def test_a_decode_launched_before_its_token_is_back_is_fed_the_future_token() -> None:
    sched = Scheduler(SchedulerConfig(max_running_requests=2, prefill_budget=16, kv_capacity_tokens=64))
    sched.add_request("A", [5, 6, 7], RequestParams(stop=Job("A", 0, 3, 9).stop_params()))
    first = sched.launch()  # the prompt; samples A's first token
    second = sched.launch()  # A's first decode, planned before that token is known
    assert first.batch.input_ids.tolist() == [5, 6, 7]
    assert second.batch.input_ids.tolist() == [FUTURE_TOKEN]
    assert second.batch.positions.tolist() == [3] and second.batch.sample_counts == [1]
    sched.complete(first, StepResult(step=first.batch.step, next_token_ids=np.asarray([FIRST_TOKEN], np.int32)))
    sched.complete(second, StepResult(step=second.batch.step, next_token_ids=np.asarray([FIRST_TOKEN + 1], np.int32)))
    third = sched.launch()  # both tokens are back: an ordinary decode
    assert third.batch.input_ids.tolist() == [FIRST_TOKEN + 1] and third.batch.positions.tolist() == [4]


def test_a_request_that_stops_while_its_next_step_runs_is_released_at_once_and_its_extra_row_dropped() -> None:
    sched = Scheduler(
        SchedulerConfig(max_running_requests=2, prefill_budget=16, kv_capacity_tokens=64), eos_token_ids=(EOS,)
    )
    sched.add_request("A", [5, 6, 7], RequestParams(stop=Job("A", 0, 3, 9).stop_params()))
    first, second = sched.launch(), sched.launch()
    out = sched.complete(first, StepResult(step=first.batch.step, next_token_ids=np.asarray([EOS], np.int32)))
    assert out.finished == ["A"] and out.finish_reasons == {"A": "stop"}
    assert sched.num_running == 0 and sched.kv_used_tokens == 0
    late = sched.complete(
        second, StepResult(step=second.batch.step, next_token_ids=np.asarray([FIRST_TOKEN], np.int32))
    )
    assert late.new_tokens == [] and late.finished == [] and not sched.has_unfinished()


def test_a_request_aborted_while_its_prompt_logprobs_are_computed_is_dropped_with_them() -> None:
    """Overlap scheduling: the client goes while its last chunk runs; the step's prompt logprobs come back
    for a slot the request no longer holds, and are dropped (they used to be looked up by its slot now)."""
    from batchserve.shared.messages import LogitsParams, StopParams, TokenLogprobs

    sched = Scheduler(SchedulerConfig(max_running_requests=2, prefill_budget=16, kv_capacity_tokens=64))
    sched.add_request(
        "a", list(range(3, 11)), RequestParams(stop=StopParams(max_tokens=4), logits=LogitsParams(prompt_logprobs=0))
    )
    first = sched.launch()
    assert sched.abort("a")
    entry = TokenLogprobs(token_id=3, logprob=0.0, top_ids=[], top_logprobs=[])
    out = sched.complete(
        first,
        StepResult(
            step=first.batch.step,
            next_token_ids=np.asarray([5], np.int32),
            prompt_logprobs=[(first.batch.slots[0], [entry] * 7)],
        ),
    )
    assert out.new_tokens == [] and out.prompt_logprobs == {}
    assert sched.launch().out.cancelled == ["a"] and not sched.has_unfinished()


def test_a_request_at_its_token_limit_is_not_launched_again() -> None:
    sched = Scheduler(SchedulerConfig(max_running_requests=2, prefill_budget=16, kv_capacity_tokens=64))
    sched.add_request("A", [5, 6, 7], RequestParams(stop=Job("A", 0, 3, 9, max_tokens=2).stop_params()))
    first, second = sched.launch(), sched.launch()  # its 1st and 2nd (last) token
    assert sched.launch().batch is None  # nothing left to launch until the last token is back
    sched.complete(first, StepResult(step=first.batch.step, next_token_ids=np.asarray([FIRST_TOKEN], np.int32)))
    out = sched.complete(
        second, StepResult(step=second.batch.step, next_token_ids=np.asarray([FIRST_TOKEN + 1], np.int32))
    )
    assert out.finish_reasons == {"A": "length"} and not sched.has_unfinished()


def test_preempting_with_a_step_in_flight_drains_it_first() -> None:
    # Two requests on estimates (rho 0.01) in a pool that cannot hold both to the end.
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=32, kv_capacity_tokens=24, page_size=4, kv_reserve_ratio=0.01
    )
    jobs = [Job("A", 0, 8, 12, ignore_eos=True), Job("B", 0, 8, 12, ignore_eos=True)]
    driver = run_overlapped(config, jobs)
    assert any(out.preempted for out in driver.outputs) and driver.drains > 0


def test_launch_refuses_to_preempt_with_steps_in_flight_and_no_drain() -> None:
    sched = Scheduler(
        SchedulerConfig(
            max_running_requests=2, prefill_budget=32, kv_capacity_tokens=24, page_size=4, kv_reserve_ratio=0.01
        ),
        eos_token_ids=(EOS,),
    )
    for rid in "AB":
        stop = Job(rid, 0, 8, 12, ignore_eos=True).stop_params()
        sched.add_request(rid, list(range(3, 11)), RequestParams(stop=stop))
    with pytest.raises(RuntimeError, match="drain"):
        for _ in range(20):
            sched.launch()


# ------------------------------------------------------------------ the real model, one step late


def test_the_model_gives_the_same_greedy_tokens_launched_ahead_as_step_by_step(tiny_model_dir) -> None:
    from batchserve.procs.worker.model_runner import ModelRunner

    model_dir = tiny_model_dir()
    prompts = {f"r{i}": list(range(10 + i, 10 + i + 5 + 3 * i)) for i in range(5)}
    limits = {"r0": 9, "r1": 4, "r2": 12, "r3": 1, "r4": 7}

    def tokens(overlap: bool) -> dict[str, list[int]]:
        torch.manual_seed(0)
        runner = ModelRunner(model_dir, device="cpu", max_running_requests=4, kv_capacity_tokens=512)
        sched = Scheduler(
            SchedulerConfig(
                max_running_requests=4,
                prefill_budget=24,
                page_size=runner.page_size,
                kv_capacity_tokens=runner.kv_capacity_tokens,
            ),
            eos_token_ids=(),
        )
        for rid, prompt in prompts.items():
            stop = Job(rid, 0, 1, 99, max_tokens=limits[rid], ignore_eos=True).stop_params()
            sched.add_request(rid, prompt, RequestParams(sampling=SamplingParams(temperature=0.0), stop=stop))
        outs: list[StepOutput] = []
        if overlap:
            driver = OverlappedDriver(sched, lambda batch, owners: runner.execute(batch))
            while sched.has_unfinished() or driver.in_flight:
                driver.turn()
            outs = driver.outputs
        else:
            while sched.has_unfinished():
                outs.append(sched.step(runner))
        got: dict[str, list[int]] = {rid: [] for rid in prompts}
        for out in outs:
            for rid, token in out.new_tokens:
                got[rid].append(token)
        return got

    step_by_step = tokens(overlap=False)
    assert {rid: len(t) for rid, t in step_by_step.items()} == limits
    assert tokens(overlap=True) == step_by_step


# ------------------------------------------------------------------ the server, both ways


@pytest.mark.parametrize("flags", [("--overlap-schedule", "on"), ("--overlap-schedule", "off")], ids=["on", "off"])
def test_the_server_streams_the_in_process_engines_tokens_with_and_without_overlap(tiny_model_dir, tmp_path, flags):
    import asyncio

    import aiohttp
    from e2e_server import reference_greedy, start_server

    model = tiny_model_dir("llama", with_tokenizer=True)
    prompts = [[5, 6, 7], [100, 3, 250, 17, 9], [42], [7] * 40, list(range(3, 60))]
    limits = [12, 3, 1, 20, 7]
    reference = [
        reference_greedy(model, [p], n, ignore_eos=True, kv_capacity_tokens=4096)[0] for p, n in zip(prompts, limits)
    ]
    server = start_server(model, tmp_path / "serve.log", "--kv-capacity-tokens", "4096", *flags)

    async def completion(session: aiohttp.ClientSession, prompt: list[int], limit: int) -> list[int]:
        body = {"model": str(model), "prompt": prompt, "max_tokens": limit, "temperature": 0, "ignore_eos": True}
        async with session.post(f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.json())["choices"][0]["text"]
        return [int(word[1:]) for word in text.split()]  # the tiny tokenizer: token t is "w<t>"

    async def main() -> list[list[int]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[completion(session, p, n) for p, n in zip(prompts * 3, limits * 3)])

    try:
        got = asyncio.run(main())
    finally:
        server.stop()
    special = {0, 1, 2}  # <unk> <s> </s>: not in the text
    assert got == [[t for t in tokens if t not in special] for tokens in reference] * 3


def test_auto_overlaps_with_a_cuda_worker_only() -> None:
    from batchserve.procs.scheduler.config import overlap_schedule
    from batchserve.shared.config import ServerConfig
    from batchserve.shared.process_messages import WorkerInfo

    def overlaps(setting: str, device: str) -> bool:
        info = WorkerInfo(kv_capacity_tokens=64, eos_token_ids=[], max_context=64, page_size=16, device_type=device)
        return overlap_schedule(ServerConfig(overlap_schedule=setting), info)

    assert overlaps("auto", "cuda") and not overlaps("auto", "cpu")
    assert overlaps("on", "cpu") and overlaps("on", "cuda")
    assert not overlaps("off", "cuda") and not overlaps("off", "cpu")


def test_a_head_that_preempts_while_steps_run_drains_them_first() -> None:
    """The path above, pinned: C (priority 0) arrives while A and B (priority 1) hold both slots with
    two steps in flight; it preempts B, which needs B's tokens known, so the pipeline drains first."""
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=16, kv_capacity_tokens=64, scheduling_policy="priority"
    )
    jobs = [Job("a", 0, 4, 10), Job("b", 0, 4, 10), Job("c", 3, 4, 3)]
    driver = run_overlapped(config, jobs, priorities={"a": 1, "b": 1, "c": 0})
    assert driver.drains >= 1
    assert [rid for out in driver.outputs for rid in out.preempted] == ["b"]
