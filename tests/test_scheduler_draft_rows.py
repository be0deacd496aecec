"""Decode rows of k tokens: a request given a draft feeds its last token and the draft in one row,
each position sampled; KV, pages, counts and stop checks advance by the row's width."""

from __future__ import annotations

import numpy as np
import pytest

from batchserve.procs.scheduler import Scheduler, SchedulerConfig
from batchserve.shared.messages import ForwardBatch, RequestParams, SamplingParams, StepResult, StopParams

EOS = 2
GREEDY = SamplingParams(temperature=0.0)


class Scripted:
    """Answers each batch with the next list of tokens, remembering the batches."""

    def __init__(self, *tokens: list[int]) -> None:
        self.tokens = [list(t) for t in tokens]
        self.batches: list[ForwardBatch] = []

    def execute(self, batch: ForwardBatch) -> StepResult:
        self.batches.append(batch)
        ids = self.tokens.pop(0)
        assert len(ids) == batch.num_sampled
        return StepResult(step=batch.step, next_token_ids=np.asarray(ids, dtype=np.int32))


def make(policy: str = "prefill-first", budget: int = 64) -> Scheduler:
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=budget, kv_capacity_tokens=64, page_size=4, policy=policy
    )  # type: ignore[arg-type]
    return Scheduler(config, eos_token_ids=(EOS,))


def test_a_two_token_draft_runs_a_row_of_width_three() -> None:
    sched = make()
    sched.add_request("A", [3, 4, 5, 6, 7], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    ex = Scripted([100], [101, 102, 103], [104])
    sched.step(ex)  # the prompt: 5 positions on pages 0-1 of the slot, the first token
    slot = 0
    page = int(sched.table.page_table[slot, 1])
    sched.set_draft("A", [50, 51])
    out = sched.step(ex)
    b = ex.batches[-1]
    assert (b.slots, b.prefix_lens, b.extend_lens, b.sample_lens, b.sample_counts) == ([0], [5], [3], [3], [1])
    assert b.input_ids.tolist() == [100, 50, 51] and b.positions.tolist() == [5, 6, 7]
    assert b.kv_locs.tolist() == [page * 4 + 1, page * 4 + 2, page * 4 + 3]
    assert b.page_table_slots.shape[0] == 0  # positions 5-7 fit in the page it holds
    assert out.decode == ["A"] and out.new_tokens == [("A", 101), ("A", 102), ("A", 103)]
    assert (sched.table.kv_len[slot], sched.table.generated[slot], sched.table.last_token[slot]) == (8, 4, 103)
    assert not sched.decode_manager.drafting and sched.table.requests[slot].draft.shape[0] == 0  # used up
    sched.step(ex)  # no draft: a row of one, on a new page
    b = ex.batches[-1]
    assert (b.prefix_lens, b.extend_lens, b.sample_lens, b.sample_counts) == ([8], [1], [1], [4])
    assert b.input_ids.tolist() == [103] and b.positions.tolist() == [8]
    assert b.page_table_slots.tolist() == [slot] and b.page_table_cols.tolist() == [2]
    assert b.kv_locs.tolist() == [int(b.page_table_pages[0]) * 4]


def test_a_stop_token_in_the_middle_of_a_row_ends_the_request_and_drops_the_rest() -> None:
    sched = make()
    sched.add_request("A", [3, 4, 5], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    sched.add_request("B", [8, 9], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10, stop_token_ids=(77,))))
    ex = Scripted([100, 200], [101, EOS, 103, 201, 77, 203])
    sched.token_deltas(sched.step(ex))
    sched.set_draft("A", [60, 61])
    sched.set_draft("B", [70, 71])
    free_before = sched.allocator.num_free
    out = sched.step(ex)
    b = ex.batches[-1]
    assert b.input_ids.tolist() == [100, 60, 61, 200, 70, 71] and b.positions.tolist() == [3, 4, 5, 2, 3, 4]
    assert b.sample_lens == [3, 3] and b.sample_counts == [1, 1]
    assert out.new_tokens == [("A", 101), ("A", EOS), ("B", 201), ("B", 77)]
    assert out.finished == ["A", "B"] and out.finish_reasons == {"A": "stop", "B": "stop"}
    assert not sched.has_unfinished() and sched.allocator.num_free > free_before
    assert [d.completion_tokens for d in sched.token_deltas(out)] == [3, 3]


def test_a_row_stays_below_the_token_limit() -> None:
    """A draft leaves its row a token below the limit: were the row rejected in part, its request
    would still be decoding (SCHEDULING.md 6.4)."""
    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=4)))
    ex = Scripted([100], [101, 102], [103])
    sched.step(ex)
    with pytest.raises(ValueError, match="passes its token limit"):
        sched.set_draft("A", [5, 6])  # 1 + 2 sampled more would reach the limit of 4
    sched.set_draft("A", [5])
    out = sched.step(ex)
    assert out.new_tokens == [("A", 101), ("A", 102)] and not out.finished
    out = sched.step(ex)
    assert out.new_tokens == [("A", 103)] and out.finish_reasons == {"A": "length"}


def test_mixed_counts_a_row_of_width_k_as_k_tokens_of_the_budget() -> None:
    sched = make("mixed", budget=8)
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    ex = Scripted([100], [101, 102, 103])
    sched.step(ex)
    sched.add_request("B", list(range(10, 30)), RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=4)))
    sched.set_draft("A", [5, 6])
    out = sched.step(ex)
    assert out.decode == ["A"] and out.prefill == [("B", 5)]  # 8 - 3
    assert (sched.decode_load().rows, sched.decode_load().pairs) == (1, 5.0 + 1)  # a row of one after 5 positions


def test_a_draft_waits_for_its_last_token_under_overlap() -> None:
    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    ex = Scripted([100], [101], [102, 103, 104])
    sched.step(ex)
    launched = sched.launch()  # A's next token in flight
    with pytest.raises(ValueError, match="not back yet"):
        sched.set_draft("A", [5, 6])
    sched.complete(launched, ex.execute(launched.batch))
    sched.set_draft("A", [5, 6])
    row = sched.launch()
    assert row.batch.input_ids.tolist() == [101, 5, 6] and row.batch.positions.tolist() == [3, 4, 5]
    with pytest.raises(RuntimeError, match="overlap"):  # its verification may roll the row back: nothing behind it
        sched.launch()
    with pytest.raises(ValueError, match="is not decoding"):
        sched.set_draft("nobody", [5])


def test_logprobs_follow_the_positions_and_a_row_whose_request_ended_in_flight_is_dropped() -> None:
    from batchserve.shared.messages import TokenLogprobs

    sched = make()
    sched.add_request("A", [3, 4], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    sched.add_request("B", [5, 6], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    ex = Scripted([100, 200])
    sched.step(ex)
    sched.set_draft("A", [7, 8])
    launched = sched.launch()
    assert launched.batch.sample_lens == [3, 1]
    assert sched.abort("B")  # while its row runs
    lps = [TokenLogprobs(t, -float(i), [], []) for i, t in enumerate([101, 102, 103, 201])]
    result = StepResult(
        step=launched.batch.step,
        next_token_ids=np.asarray([101, 102, 103, 201], dtype=np.int32),
        logprob_rows=[0, 1, 2, 3],
        logprobs=lps,
    )
    out = sched.complete(launched, result)
    assert out.new_tokens == [("A", 101), ("A", 102), ("A", 103)] and out.logprobs == {"A": lps[:3]}


def test_a_row_that_ends_early_caches_only_the_tokens_its_request_kept() -> None:
    """EOS inside a row the verification accepted whole: the row's KV past it is rolled back, so the
    prefix cache files exactly the request's own tokens under its pages."""
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=64, kv_capacity_tokens=64, page_size=1, prefix_cache=True
    )
    sched = Scheduler(config, eos_token_ids=(EOS,))
    sched.add_request("A", [3, 4, 5, 6], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=10)))
    sched.step(Scripted([100]))
    sched.set_draft("A", [101, 102, 103])

    class AllAccepted(Scripted):
        def execute(self, batch):
            result = super().execute(batch)
            result.accepted_lens = [4]
            return result

    out = sched.step(AllAccepted([101, EOS, 103, 104]))
    assert out.new_tokens == [("A", 101), ("A", EOS)] and out.finish_reasons == {"A": "stop"}
    assert out.drafted == [("A", 3, 1)]  # what counted: 101 (EOS came in place of 102)
    cached = sched.kv.cache.match(np.asarray([3, 4, 5, 6, 100, 101, EOS, 103, 104]), 8)
    assert len(cached) == 6  # positions 0-5 hold 3 4 5 6 100 101; the KV of 102 and 103 is not filed
    assert sched.kv_used_tokens == 0


def test_drafts_are_dropped_before_they_would_cost_a_preemption() -> None:
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=64, kv_capacity_tokens=16, page_size=4, kv_reserve_ratio=0.05
    )
    sched = Scheduler(config, eos_token_ids=(EOS,))
    sched.add_request("A", [3, 4, 5, 6, 7, 8, 9], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=8)))
    sched.add_request("B", [13, 14, 15, 16, 17, 18, 19], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=8)))
    ex = Scripted([100, 200], [101, 201])
    sched.step(ex)  # both prompts on 2 pages each: the pool's 4 pages are all held
    sched.set_draft("A", [101, 102, 103])  # its row would need a fifth page
    out = sched.step(ex)
    assert out.preempted == [] and ex.batches[-1].extend_lens == [1, 1]
    assert not sched.decode_manager.drafting and out.new_tokens == [("A", 101), ("B", 201)]


def test_proposed_drafts_count_in_the_decode_load_the_step_time_bound_sizes_with() -> None:
    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=64, kv_capacity_tokens=256, page_size=4, speculative="ngram", ngram_min=1
    )
    sched = Scheduler(config, eos_token_ids=(EOS,))
    sched.add_request("A", [5, 6, 7, 8, 5, 6, 7, 8, 5], RequestParams(sampling=GREEDY, stop=StopParams(max_tokens=20)))
    sched.step(Scripted([6]))
    assert sched.decode_load().tokens == 1
    sched.planner.propose_drafts()  # what launch does first, before it sizes the step
    assert sched.decode_load().tokens == 1 + 4  # "7 8 5 6" occurred before, followed by 7 8 5 6
    sched.decode_manager.clear_drafts()
    launched = sched.launch()
    assert launched.batch.extend_lens == [5]  # launch proposed the same draft and packed it
