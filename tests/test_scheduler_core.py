"""The scheduler's public API: the ForwardBatch it plans, stop conditions, aborts, rejections, config."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import EOS, FIRST_TOKEN, Job, run_and_check

from batchserve.procs.scheduler import ExecutorError, Scheduler, SchedulerConfig, SchedulerConfigError, ScriptedExecutor
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import ForwardBatch, RequestParams, SamplingParams, StepResult, StopParams

GREEDY = SamplingParams(temperature=0.0)


class Recorder:
    """Answers each batch with the given tokens (default: FIRST_TOKEN + k), remembering the batches."""

    def __init__(self, tokens: list[list[int]] | None = None) -> None:
        self.batches: list[ForwardBatch] = []
        self.tokens = None if tokens is None else [list(t) for t in tokens]

    def execute(self, batch: ForwardBatch) -> StepResult:
        self.batches.append(batch)
        ids = (
            self.tokens.pop(0)
            if self.tokens
            else [FIRST_TOKEN + c + j for c, n in zip(batch.sample_counts, batch.sample_lens) for j in range(n)]
        )
        return StepResult(step=batch.step, next_token_ids=np.asarray(ids, dtype=np.int32))


def make(
    policy: str = "prefill-first",
    *,
    slots: int = 4,
    budget: int = 64,
    capacity: int = 256,
    page_size: int = 1,
    max_context: int = 0,
    max_waiting: int = 0,
    eos: tuple[int, ...] = (EOS,),
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_running_requests=slots,
            prefill_budget=budget,
            kv_capacity_tokens=capacity,
            page_size=page_size,
            policy=policy,
            max_context=max_context,  # type: ignore[arg-type]
            max_waiting=max_waiting,
        ),
        eos_token_ids=eos,
    )


def test_forward_batch_fields_for_chunks_and_decode_with_pages_of_4() -> None:
    sched = make(budget=3, page_size=4, capacity=32)
    sched.add_request(
        "A",
        [10, 11, 12, 13, 14],
        RequestParams(sampling=SamplingParams(temperature=0.5, seed=7), stop=StopParams(max_tokens=3)),
    )
    rec = Recorder()

    out = sched.step(rec)  # first chunk: 3 tokens into page 1, samples nothing
    b = rec.batches[-1]
    assert (b.step, b.slots, b.prefix_lens, b.extend_lens, b.sample_lens, b.sample_counts) == (
        0,
        [0],
        [0],
        [3],
        [0],
        [0],
    )
    assert b.sampling == [SamplingParams(temperature=0.5, seed=7)]
    assert b.input_ids.tolist() == [10, 11, 12] and b.positions.tolist() == [0, 1, 2]
    assert b.kv_locs.tolist() == [4, 5, 6]
    assert (b.page_table_slots.tolist(), b.page_table_cols.tolist(), b.page_table_pages.tolist()) == ([0], [0], [1])
    assert out.prefill == [("A", 3)] and out.new_tokens == [] and out.finished == []
    assert sched.kv_used_tokens == 4 and sched.kv.reserved_pages() * sched.page_size == 8  # ceil((5 + 3) / 4) pages

    out = sched.step(rec)  # last chunk: position 3 ends page 1, position 4 starts page 2; samples
    b = rec.batches[-1]
    assert (b.prefix_lens, b.extend_lens, b.sample_lens) == ([3], [2], [1])
    assert b.input_ids.tolist() == [13, 14] and b.kv_locs.tolist() == [7, 8]
    assert (b.page_table_cols.tolist(), b.page_table_pages.tolist()) == ([1], [2])
    assert out.new_tokens == [("A", FIRST_TOKEN)]

    out = sched.step(rec)  # decode: feeds the sampled token back at position 5, same page
    b = rec.batches[-1]
    assert (b.prefix_lens, b.extend_lens, b.sample_lens, b.sample_counts) == ([5], [1], [1], [1])  # a decode row
    assert b.input_ids.tolist() == [FIRST_TOKEN] and b.positions.tolist() == [5] and b.kv_locs.tolist() == [9]
    assert b.page_table_pages.shape == (0,)
    assert out.decode == ["A"] and out.new_tokens == [("A", FIRST_TOKEN + 1)]

    out = sched.step(rec)
    assert out.finished == ["A"] and out.finish_reasons == {"A": "length"}
    assert sched.kv_used_tokens == 0 and sched.num_running == 0 and not sched.has_unfinished()
    assert sched.num_pool_pages == 9


def test_mixed_batch_puts_decodes_first_and_reports_batch_order() -> None:
    sched = make("mixed", slots=2, budget=8)
    sched.add_request("A", [5, 6], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=4)))
    rec = Recorder()
    sched.step(rec)
    sched.add_request("B", [7, 8, 9], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=4)))
    out = sched.step(rec)
    b = rec.batches[-1]
    assert b.slots == [0, 1] and b.extend_lens == [1, 3] and b.sample_lens == [1, 1]
    assert b.input_ids.tolist() == [FIRST_TOKEN, 7, 8, 9]
    assert out.decode == ["A"] and out.prefill == [("B", 3)] and out.batch_size == 2
    assert out.new_tokens == [("A", FIRST_TOKEN + 1), ("B", FIRST_TOKEN)]


@pytest.mark.parametrize(
    ("stop", "tokens", "n", "reason"),
    [
        (StopParams(max_tokens=5), [[FIRST_TOKEN], [EOS]], 2, "stop"),
        (StopParams(max_tokens=5, ignore_eos=True), [[FIRST_TOKEN], [EOS], [EOS], [7], [8]], 5, "length"),
        (StopParams(max_tokens=5, ignore_eos=True, stop_token_ids=(42,)), [[EOS], [42]], 2, "stop"),
        (StopParams(max_tokens=2), [[FIRST_TOKEN], [7]], 2, "length"),
        (StopParams(max_tokens=2), [[FIRST_TOKEN], [EOS]], 2, "stop"),  # EOS as the last allowed token: stop
    ],
)
def test_stop_conditions(stop: StopParams, tokens: list[list[int]], n: int, reason: str) -> None:
    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=stop))
    rec = Recorder(tokens)
    outs = []
    while sched.has_unfinished():
        outs.append(sched.step(rec))
    got = [t for o in outs for _, t in o.new_tokens]
    assert got == [t for step in tokens for t in step][:n]  # the stop token itself is included
    assert outs[-1].finished == ["A"] and outs[-1].finish_reasons == {"A": reason}
    assert sched.kv_used_tokens == 0


def test_context_limit_finishes_with_length() -> None:
    # (a request longer than the context never gets here: the tokenizer settles max_tokens)
    sched = make(max_context=6)
    sched.add_request("A", [3, 4, 5, 6], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=2)))
    rec = Recorder()
    outs = [sched.step(rec), sched.step(rec)]
    assert outs[-1].finish_reasons == {"A": "length"}
    assert sched.max_pages_per_request == 6


@pytest.mark.parametrize(
    ("prompt", "stop", "message"),
    [
        ([], StopParams(), "the prompt is empty"),
        ([[1, 2]], StopParams(), "one-dimensional"),
        ([1.5, 2.0], StopParams(), "must be integers"),
        ([1, -4], StopParams(), "in [0, 2**31)"),
        (["a"], StopParams(), "must be integers"),
        (list(range(250)), StopParams(max_tokens=7), "can never fit in the KV cache of 256 tokens"),
    ],
)
def test_requests_that_could_never_run_are_rejected(prompt: list, stop: StopParams, message: str) -> None:
    sched = make()
    with pytest.raises(Refusal) as info:
        sched.add_request("X", prompt, RequestParams(sampling=GREEDY, stop=stop))
    assert message in str(info.value) and isinstance(info.value, ValueError)
    assert not sched.has_unfinished() and sched.num_waiting == 0


def test_duplicate_ids_are_rejected_until_the_first_one_ends() -> None:
    sched = make()
    sched.add_request("A", [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=1)))
    with pytest.raises(Refusal, match="already queued or running"):
        sched.add_request("A", [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=1)))
    assert sched.step(Recorder()).finished == ["A"]
    sched.add_request(
        "A", np.array([3, 4], dtype=np.int64), RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=1))
    )


def test_a_full_server_answers_503_counting_running_and_waiting() -> None:
    sched = make(slots=2, max_waiting=2)
    for rid in ("A", "B", "C"):
        sched.add_request(rid, [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=16)))
    sched.step(Recorder())  # A and B run, C waits
    sched.add_request("D", [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=16)))
    with pytest.raises(Refusal, match="server is full") as info:
        sched.add_request("E", [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=16)))
    assert info.value.status == 503
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_abort_waiting_mid_chunk_and_running_frees_everything_at_once() -> None:
    sched = make(slots=2, budget=4, capacity=64)
    for rid, n in (("R", 2), ("M", 6), ("W", 3)):
        sched.add_request(rid, list(range(3, 3 + n)), RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=8)))
    rec = Recorder()
    out = sched.step(rec)  # R whole, M's first 2 tokens; W waits (no slot)
    assert out.prefill == [("R", 2), ("M", 2)] and sched.num_waiting == 1
    assert sched.kv_used_tokens == 4

    assert sched.abort("W") and sched.num_waiting == 0
    assert sched.abort("M")  # mid-chunk: its slot and 2 pages come back now
    assert sched.num_running == 1 and sched.kv_used_tokens == 2
    assert sched.kv.reserved_pages() * sched.page_size == 2 + 8 - 1
    assert sched.abort("R")
    assert sched.num_running == 0 and sched.kv_used_tokens == 0 and sched.kv.reserved_pages() * sched.page_size == 0
    assert sched.allocator.num_free == 64
    assert not sched.abort("R") and not sched.abort("nobody")

    assert sched.has_unfinished()  # until a step has reported the cancellations
    out = sched.step(rec)  # idle: reports the cancellations, runs nothing
    assert sorted(out.cancelled) == ["M", "R", "W"] and out.batch_size == 0 and len(rec.batches) == 1
    assert not sched.has_unfinished()
    assert sched.step(rec).cancelled == []


def test_abort_of_a_finished_request_is_ignored() -> None:
    sched = make()
    sched.add_request("A", [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=1)))
    sched.step(Recorder())
    assert not sched.abort("A")
    assert sched.step(Recorder()).cancelled == []


def test_abort_from_inside_the_executor_is_applied_after_the_step() -> None:
    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=5)))
    sched.add_request("B", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=5)))

    class Aborting(Recorder):
        def execute(self, batch: ForwardBatch) -> StepResult:
            assert sched.abort("B")
            return super().execute(batch)

    out = sched.step(Aborting())
    assert out.new_tokens == [("A", FIRST_TOKEN), ("B", FIRST_TOKEN)] and out.cancelled == []
    assert sched.num_running == 1 and sched.kv_used_tokens == 2
    a, b = sched.token_deltas(out)  # B's token still goes out as its first delta, counted
    assert (b.rid, b.completion_tokens, b.prompt_tokens, b.stop) == ("B", 1, 2, StopParams(max_tokens=5))
    last = sched.step(Recorder())
    assert last.cancelled == ["B"]
    assert [(d.rid, d.finish_reason, d.completion_tokens) for d in sched.token_deltas(last)][-1] == ("B", "abort", 1)


def test_executor_returning_the_wrong_number_of_tokens_is_an_error() -> None:
    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=5)))
    with pytest.raises(ExecutorError, match="expected 1 token ids"):
        sched.step(Recorder([[1, 2]]))


def test_idle_steps_count_and_do_not_call_the_executor() -> None:
    sched = make()
    rec = Recorder()
    assert [sched.step(rec).step for _ in range(3)] == [0, 1, 2]
    assert rec.batches == []
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=1)))
    assert sched.step(rec).step == 3 and rec.batches[0].step == 3


def test_without_eos_ids_only_max_tokens_and_stop_ids_end_a_request() -> None:
    sched = make(eos=())
    sched.add_request("A", [3], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=3)))
    rec = Recorder([[EOS], [EOS], [EOS]])
    outs = [sched.step(rec) for _ in range(3)]
    assert outs[-1].finish_reasons == {"A": "length"}


def test_scripted_executor_emits_eos_as_the_nth_token() -> None:
    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    ex = ScriptedExecutor(lambda slot: 3, eos_token_id=EOS)
    tokens = []
    while sched.has_unfinished():
        tokens += [t for _, t in sched.step(ex).new_tokens]
    assert tokens == [100, 101, EOS]
    with pytest.raises(ValueError):
        ScriptedExecutor(lambda slot: 1, eos_token_id=5, first_token_id=5)


def test_long_prompts_grow_the_page_table_and_stay_consistent() -> None:
    config = SchedulerConfig(
        max_running_requests=3, prefill_budget=50, kv_capacity_tokens=2000, page_size=1, policy="mixed"
    )
    jobs = [Job(f"r{i}", arrival_step=i, input_tokens=300 + 7 * i, output_tokens=20 + i) for i in range(5)]
    run_and_check(config, jobs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_running_requests": 0}, "max_running_requests must be >= 1"),
        ({"prefill_budget": 0}, "prefill_budget must be >= 1"),
        ({"kv_capacity_tokens": 0}, "kv_capacity_tokens must be >= 1"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"page_size": 16, "kv_capacity_tokens": 8}, "at least one page"),
        ({"max_context": -1}, "max_context must be >= 0"),
        ({"policy": "lifo"}, "policy must be one of"),
        ({"policy": "mixed", "prefill_budget": 4, "max_running_requests": 4}, "prefill_budget > max_running_requests"),
    ],
)
def test_unworkable_configs_are_refused(fields: dict, message: str) -> None:
    values = {"max_running_requests": 2, "prefill_budget": 8, "kv_capacity_tokens": 64, **fields}
    with pytest.raises(SchedulerConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        SchedulerConfig(**values)


def test_capacity_is_rounded_down_to_whole_pages() -> None:
    sched = make(capacity=70, page_size=16)
    assert sched.kv_capacity_tokens == 64 and sched.num_pool_pages == 5
