"""Speculative decoding in the scheduler (`speculative="ngram"`): prompt-lookup drafts go into decode
rows, a scripted model verifies them as the worker does (`SampleRows.accepted`), and rejected tokens
are rolled back (KV positions, generated counts, pages).

The scripted model copies each request's prompt with a detour every few tokens, so that drafts are
often right and sometimes wrong. Every request must get exactly the tokens and the finish reason
plain decoding gives it, under every policy, with the prefix cache and with preemptions; every KV
position a step reads must hold its request's own token; and at the end nothing may be held.
"""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import audit_references

from batchserve.procs.scheduler import POLICIES, Scheduler, SchedulerConfig, StepOutput
from batchserve.procs.scheduler.config import SchedulerConfigError, check_config
from batchserve.procs.worker.sample_rows import SampleRows
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import ForwardBatch, RequestParams, SamplingParams, StepResult, StopParams

EOS = 2
WRONG = 1  # what the model says after a fed token that was not the request's own


class Job:
    """A request whose k-th token copies its prompt, except a detour every `detour` tokens, and which
    says EOS as token `eos_at` (0-based) unless `ignore_eos`."""

    def __init__(
        self,
        index: int,
        prompt_len: int,
        max_tokens: int,
        eos_at: int,
        detour: int,
        ignore_eos: bool = False,
        arrival: int = 0,
        speculative: bool = True,
    ) -> None:
        self.rid = f"r{index}"
        self.prompt = [3 + 50 * index + j for j in range(prompt_len)]
        self.max_tokens, self.eos_at, self.detour = max_tokens, eos_at, detour
        self.ignore_eos, self.arrival, self.speculative = ignore_eos, arrival, speculative

    def token(self, k: int) -> int:
        if k == self.eos_at:
            return EOS
        if k % self.detour == self.detour - 1:
            return 1000 + k
        return self.prompt[k % len(self.prompt)]

    def expected(self) -> tuple[list[int], str]:
        for k in range(self.max_tokens):
            if self.token(k) == EOS and not self.ignore_eos:
                return [self.token(i) for i in range(k + 1)], "stop"
        return [self.token(i) for i in range(self.max_tokens)], "length"


class CopyModel:
    """Plays the worker: a sampled position gives its request's next scripted token when every token
    fed before it in the row is the request's own, else `WRONG`; verification as the worker's. Checks
    the KV every step reads, through its own page table."""

    def __init__(self, sched: Scheduler, jobs: dict[str, Job]) -> None:
        self.sched, self.jobs = sched, jobs
        self.P = sched.page_size
        self.page_table: dict[tuple[int, int], int] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # flat KV location -> (token, position)
        self.kept: dict[str, list[int]] = {rid: [] for rid in jobs}  # tokens verification kept
        self.widths: dict[str, list[int]] = {rid: [] for rid in jobs}  # each decode row's width

    def loc(self, slot: int, q: int) -> int:
        return self.page_table[(slot, q // self.P)] * self.P + q % self.P

    def execute(self, batch: ForwardBatch) -> StepResult:
        for slot, col, page in zip(
            batch.page_table_slots.tolist(), batch.page_table_cols.tolist(), batch.page_table_pages.tolist()
        ):
            self.page_table[(slot, col)] = page
        out: list[int] = []
        owners: list[str] = []
        offset = 0
        for i, slot in enumerate(batch.slots):
            rid = self.sched.rid_in_slot(slot)
            assert rid is not None
            job, kept = self.jobs[rid], self.kept[rid]
            seq = job.prompt + kept
            p, e, n = batch.prefix_lens[i], batch.extend_lens[i], batch.sample_lens[i]
            fed = batch.input_ids[offset : offset + e].tolist()
            offset += e
            for q in range(p):
                assert self.kv.get(self.loc(slot, q)) == (seq[q], q), f"{rid}: KV at {q} is not its own token"
            known = min(e, len(seq) - p)  # prefill feeds known tokens only; a decode row its last token first
            assert fed[:known] == seq[p : p + known], f"{rid}: fed the wrong tokens"
            for q, token in zip(range(p, p + e), fed):
                self.kv[self.loc(slot, q)] = (token, q)
            if n == e and p == len(seq) - 1:  # a decode row: its last token, then its draft
                self.widths[rid].append(e)
                assert n == 1 or len(kept) + n < job.max_tokens, f"{rid}: a draft row reaching its token limit"
            assert batch.sample_counts[i] == len(kept)
            for j in range(n):
                fed_before = fed[e - n + 1 : e - n + 1 + j]  # the proposed tokens before this position
                right = fed_before == [job.token(len(kept) + m) for m in range(j)]
                out.append(job.token(len(kept) + j) if right else WRONG)
            if n:
                owners.append(rid)
        tokens = np.asarray(out, dtype=np.int32)
        rows = SampleRows.of_batch(batch)
        accepted = rows.accepted(tokens)
        for rid, first, count in zip(owners, rows.firsts.tolist(), accepted.tolist()):
            self.kept[rid] += tokens[first : first + count].tolist()
        return StepResult(
            step=batch.step, next_token_ids=tokens, accepted_lens=accepted.tolist() if rows.width > 1 else []
        )


def run(
    config: SchedulerConfig, jobs: list[Job], max_steps: int = 3000
) -> tuple[Scheduler, CopyModel, list[StepOutput]]:
    sched = Scheduler(config, eos_token_ids=(EOS,))
    model = CopyModel(sched, {j.rid: j for j in jobs})
    outputs = []
    for step in range(max_steps):
        for job in jobs:
            if job.arrival == step:
                stop = StopParams(max_tokens=job.max_tokens, ignore_eos=job.ignore_eos)
                params = RequestParams(sampling=SamplingParams(temperature=0.0), stop=stop, speculative=job.speculative)
                sched.add_request(job.rid, job.prompt, params)
        if step > max(j.arrival for j in jobs) and not sched.has_unfinished():
            return sched, model, outputs
        outputs.append(sched.step(model))
    raise AssertionError("the workload did not finish")


def results(outputs: list[StepOutput]) -> dict[str, tuple[list[int], str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for out in outputs:
        for rid, token in out.new_tokens:
            tokens.setdefault(rid, []).append(token)
        reasons.update(out.finish_reasons)
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def workload() -> list[Job]:
    return [
        Job(0, 12, 40, 30, 7),
        Job(1, 5, 25, 99, 5, arrival=1),
        Job(2, 20, 33, 99, 9, ignore_eos=True),
        Job(3, 3, 12, 8, 4, arrival=4),
        Job(4, 9, 50, 44, 8, arrival=6),
        Job(5, 16, 6, 99, 3, arrival=9),
        Job(6, 7, 30, 99, 6, arrival=2, speculative=False),
    ]


def config(
    policy: str,
    speculative: str,
    *,
    prefix_cache: bool = False,
    capacity: int = 2048,
    page_size: int = 4,
    reserve: float = 1.0,
) -> SchedulerConfig:
    return SchedulerConfig(
        max_running_requests=4,
        prefill_budget=32,
        kv_capacity_tokens=capacity,
        page_size=page_size,
        policy=policy,
        prefix_cache=prefix_cache,  # type: ignore[arg-type]
        kv_reserve_ratio=reserve,
        speculative=speculative,  # type: ignore[arg-type]
        num_speculative_tokens=4,
        ngram_min=2,
        ngram_max=3,
    )


def assert_nothing_held(sched: Scheduler) -> None:
    assert sched.kv_used_tokens == 0 and sched.table.num_used == 0
    cached = sched.kv.cache.num_pages if sched.kv.cache is not None else 0
    assert sched.allocator.num_free + cached == sched.num_kv_pages


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("policy", POLICIES)
def test_speculative_rows_give_exactly_the_tokens_of_plain_decoding(policy: str, prefix_cache: bool) -> None:
    jobs = workload()
    plain_sched, _, plain = run(config(policy, "off", prefix_cache=prefix_cache), jobs)
    sched, model, spec = run(config(policy, "ngram", prefix_cache=prefix_cache), jobs)
    expected = {j.rid: j.expected() for j in jobs}
    assert results(plain) == expected
    assert results(spec) == expected
    drafted = sum(len(o.drafted) for o in spec)
    draft_tokens, accepted = sum(o.draft_tokens for o in spec), sum(o.accepted_tokens for o in spec)
    assert drafted > 0 and 0 < accepted < draft_tokens  # drafts were right and wrong
    assert len(spec) < len(plain)  # several tokens per step
    assert max(model.widths["r6"]) == 1 and max(model.widths["r0"]) > 1  # r6 opted out
    assert_nothing_held(sched)
    assert_nothing_held(plain_sched)
    if prefix_cache:
        audit_references(sched)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_rolled_back_rows_survive_preemption(policy: str, page_size: int) -> None:
    """A pool too small for every output with a 5 % estimate: requests are preempted and recomputed
    from the tokens verification kept, and the pages of rejected tokens come back."""
    jobs = workload()
    sched, _, spec = run(config(policy, "ngram", capacity=64, page_size=page_size, reserve=0.05), jobs)
    assert sum(len(o.preempted) for o in spec) > 0
    assert sum(o.accepted_tokens for o in spec) > 0
    assert results(spec) == {j.rid: j.expected() for j in jobs}
    assert_nothing_held(sched)


def test_a_rejection_frees_the_pages_past_the_kept_tokens() -> None:
    job = Job(0, 8, 20, 99, 3)  # a detour every third token: drafts are cut short
    sched = Scheduler(config("prefill-first", "ngram", page_size=1), eos_token_ids=(EOS,))
    model = CopyModel(sched, {job.rid: job})
    sched.add_request(
        job.rid,
        job.prompt,
        RequestParams(sampling=SamplingParams(temperature=0.0), stop=StopParams(max_tokens=job.max_tokens)),
    )
    rejected = 0
    while sched.has_unfinished():
        out = sched.step(model)
        if out.drafted and out.accepted_tokens < out.draft_tokens:
            rejected += 1
        if sched.table.requests[0] is not None:
            # page size 1: one page per KV position, the rejected ones' pages given back
            assert sched.table.num_pages[0] == sched.table.kv_len[0]
            assert sched.allocator.num_used == sched.table.kv_len[0]
    assert rejected > 0


def test_a_step_with_drafts_must_complete_before_the_next_launch() -> None:
    sched = Scheduler(config("prefill-first", "ngram"), eos_token_ids=(EOS,))
    job = Job(0, 6, 20, 99, 50)
    model = CopyModel(sched, {job.rid: job})
    sched.add_request(
        job.rid,
        job.prompt,
        RequestParams(sampling=SamplingParams(temperature=0.0), stop=StopParams(max_tokens=job.max_tokens)),
    )
    while True:
        launched = sched.launch()
        b = launched.batch
        # a decode-only step with a draft: every row continues its prefix and samples each token it feeds
        if b is not None and max(b.extend_lens) > 1 and b.extend_lens == b.sample_lens and min(b.prefix_lens) > 0:
            break
        sched.complete(launched, model.execute(launched.batch))
    with pytest.raises(RuntimeError, match="overlap"):
        sched.launch()
    sched.complete(launched, model.execute(launched.batch))
    sched.launch()


def test_settings_are_checked() -> None:
    with pytest.raises(SchedulerConfigError, match="ngram_min"):
        SchedulerConfig(
            max_running_requests=1,
            prefill_budget=8,
            kv_capacity_tokens=64,
            speculative="ngram",
            ngram_min=3,
            ngram_max=2,
        )
    with pytest.raises(SchedulerConfigError, match="num_speculative_tokens"):
        SchedulerConfig(max_running_requests=1, prefill_budget=8, kv_capacity_tokens=64, num_speculative_tokens=0)
    with pytest.raises(SchedulerConfigError, match="speculative must be"):
        SchedulerConfig(max_running_requests=1, prefill_budget=8, kv_capacity_tokens=64, speculative="eagle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overlap"):
        check_config(ServerConfig(speculative="ngram", overlap_schedule="on"))
    check_config(ServerConfig(speculative="ngram"))
    for bad in (
        ServerConfig(speculative="draft"),
        ServerConfig(draft_model="m"),
        ServerConfig(speculative="ngram", draft_model="m"),
    ):
        with pytest.raises(ValueError, match="draft_model"):
            check_config(bad)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        check_config(ServerConfig(speculative="draft", draft_model="m", tensor_parallel_size=2))
    check_config(ServerConfig(speculative="draft", draft_model="m"))


def test_drafts_that_do_not_pay_back_off_and_none_is_proposed_when_none_can_pay() -> None:
    """`min_acceptance`: the server's break-even share of accepted draft tokens (its step-cost model)."""

    def drafts(min_acceptance: float) -> tuple[int, list[StepOutput]]:
        job = Job(0, 30, 60, 99, 4)  # a detour every fourth token: a 4-token draft gets 2 of 4 at best
        sched = Scheduler(config("prefill-first", "ngram"), eos_token_ids=(EOS,))
        sched.planner.min_acceptance = min_acceptance
        model = CopyModel(sched, {job.rid: job})
        sched.add_request(
            job.rid,
            job.prompt,
            RequestParams(sampling=SamplingParams(temperature=0.0), stop=StopParams(max_tokens=job.max_tokens)),
        )
        outputs = []
        while sched.has_unfinished():
            outputs.append(sched.step(model))
        assert results(outputs) == {job.rid: job.expected()}
        return sum(len(o.drafted) for o in outputs), outputs

    eager, _ = drafts(0.0)
    wary, _ = drafts(0.6)  # no draft here gets more than half accepted: each one doubles the pause
    assert eager > 2 * wary > 0
    assert drafts(1.0)[0] == 0
