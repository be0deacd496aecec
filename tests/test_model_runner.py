"""ModelRunner contract: KV sizing, page-table updates, malformed batches rejected, sampling wiring, and
decode rows of several tokens (teacher forcing: the same tokens and KV as single-token steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_batches import GREEDY, _plan, _Request, generate_greedy

from batchserve.procs.scheduler import Scheduler, SchedulerConfig
from batchserve.procs.worker import model_runner
from batchserve.procs.worker.kv_cache import GIB, kv_bytes_per_token, num_pages_for
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.messages import (
    FUTURE_TOKEN,
    PLAIN_LOGITS,
    LogitsParams,
    RequestParams,
    SamplingParams,
    SlotStart,
    StopParams,
)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(
        tiny_model_dir("llama"),
        device="cpu",
        page_size=4,
        kv_capacity_tokens=256,
        max_running_requests=4,
        max_context=64,
    )


def _prefill(prompts, page_size, slots=None, free_pages=None):
    requests = [_Request(p, 0, slot=i if slots is None else slots[i]) for i, p in enumerate(prompts)]
    free = list(range(60, 0, -1)) if free_pages is None else free_pages
    return requests, _plan(0, [(r, r.prompt, True) for r in requests], page_size, free)


def test_kv_capacity_from_memory_budget():
    import torch

    per_token = kv_bytes_per_token(30, 3, 64, torch.float32)
    assert per_token == 2 * 30 * 3 * 64 * 4
    pages = num_pages_for(16, memory_gb=1.0, bytes_per_token=per_token)
    assert (pages - 1) * 16 * per_token <= GIB < (pages + 1) * 16 * per_token
    assert num_pages_for(16, capacity_tokens=33) == 4  # 3 usable pages + the dummy page


def test_capacity_excludes_dummy_page(runner):
    assert runner.kv_capacity_tokens == 256
    assert runner.kv_cache.num_pages == 256 // 4 + 1


def test_page_table_updates_are_applied(runner):
    _, batch = _prefill([[5, 6, 7, 8, 9]], runner.page_size, slots=[2])
    runner.execute(batch)
    cols = batch.page_table_cols.tolist()
    assert runner.kv_cache.page_table[2, cols].tolist() == batch.page_table_pages.tolist()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: setattr(b, "kv_locs", b.kv_locs[:-1]), "disagree"),
        (lambda b: b.kv_locs.__setitem__(0, 10**6), "kv_locs out of range"),
        (lambda b: b.input_ids.__setitem__(0, 10**6), "token id out of range"),
        (lambda b: setattr(b, "slots", [9]), "slot out of range"),
        (lambda b: setattr(b, "sample_lens", []), "differ in length"),
        (lambda b: setattr(b, "page_table_pages", np.asarray([10**6], dtype=np.int32)), "page out of range"),
        (lambda b: b.positions.__setitem__(0, 64), "position out of range"),
    ],
)
def test_malformed_batch_is_rejected(runner, corrupt, message, monkeypatch):
    monkeypatch.setattr(model_runner, "DEBUG_CHECKS", True)  # the per-step checks run only when debugging
    _, batch = _prefill([[5, 6, 7]], runner.page_size)
    corrupt(batch)
    with pytest.raises(ValueError, match=message):
        runner.execute(batch)


def test_intermediate_chunk_returns_no_tokens(runner):
    requests, batch = _prefill([[5, 6, 7]], runner.page_size)
    batch.sample_lens = [0]
    result = runner.execute(batch)
    assert result.step == batch.step and result.next_token_ids.shape == (0,)


def test_seeded_sampling_is_independent_of_the_batch(runner):
    """A seeded request samples the same tokens alone and beside others (sample_counts advance it)."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)

    def run(prompts, params):
        return _generate(runner, prompts, params, steps=6)

    alone = run([[11, 12, 13, 14]], [seeded])[0]
    together = run([[20, 21], [11, 12, 13, 14], [30, 31, 32]], [GREEDY, seeded, SamplingParams(temperature=1.0)])[1]
    assert alone == together


def _generate(runner, prompts, params, steps):
    """Like generate_greedy, with per-request sampling params (one packed prefill, then decodes)."""
    free = list(range(runner.kv_cache.num_pages - 1, 0, -1))
    requests, batch = _prefill(prompts, runner.page_size, free_pages=free)
    batch.sampling = list(params)
    outputs = [[t] for t in runner.execute(batch).next_token_ids.tolist()]
    for r in requests:
        r.fed = len(r.prompt)
    for step in range(1, steps):
        rows = [(r, [out[-1]], True) for r, out in zip(requests, outputs)]
        batch = _plan(step, rows, runner.page_size, free)
        batch.sampling = list(params)
        batch.sample_counts = [len(out) for out in outputs]
        for out, token in zip(outputs, runner.execute(batch).next_token_ids.tolist()):
            out.append(token)
        for r in requests:
            r.fed += 1
    return outputs


def test_greedy_unaffected_by_stale_slots_and_pages(tiny_model_dir):
    """Slots and pages recycled from finished requests (stale page-table rows) change nothing."""
    runner = ModelRunner(
        tiny_model_dir("qwen3"), device="cpu", page_size=2, kv_capacity_tokens=96, max_running_requests=2
    )
    prompts = [[7, 8, 9, 10, 11, 12, 13], [40, 41], [50, 51, 52, 53, 54]]
    first = generate_greedy(runner, prompts[:2], 12)
    again = generate_greedy(runner, prompts[:2], 12)
    assert first == again
    solo = generate_greedy(runner, prompts[2:], 12)
    assert generate_greedy(runner, prompts[2:], 12, chunk=3) == solo


# -- decode rows of several tokens --------------------------------------------------------------------

PROMPT = [5, 9, 11, 17, 23, 29]  # 6 tokens: a row of 3 after it crosses a page boundary (page_size 4)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
# token 40 is sampled while its bias outweighs its frequency penalty: 3 times, the last two in the row of 3,
# whose last position must then see it counted twice more
PENALIZED = LogitsParams(
    frequency_penalty=40.0,
    presence_penalty=0.5,
    repetition_penalty=1.3,
    min_tokens=5,
    logit_bias={40: 100.0},
    logprobs=2,
)


@pytest.fixture
def fresh(tiny_model_dir):
    """A runner of its own: no slot keeps another test's logits state."""
    return ModelRunner(
        tiny_model_dir("llama"),
        device="cpu",
        page_size=4,
        kv_capacity_tokens=256,
        max_running_requests=4,
        max_context=64,
    )


def _run(runner, rows, free, *, step=1, sampling=GREEDY, starts=()):
    """Execute one batch of (request, tokens fed, positions sampled) rows; each row's tokens are
    appended to its request's output. Returns the StepResult."""
    batch = _plan(step, rows, runner.page_size, free)
    batch.sampling = [sampling] * len(rows)
    batch.slot_starts = list(starts)
    result = runner.execute(batch)
    tokens = iter(result.next_token_ids.tolist())
    for r, fed, n in rows:
        r.fed += len(fed)
        r.output += [next(tokens) for _ in range(n)]
    return result


def _kv(runner, request, positions):
    size = runner.page_size
    locs = [request.pages[p // size] * size + p % size for p in positions]
    return [t[locs] for t in (*runner.kv_cache.k_flat, *runner.kv_cache.v_flat)]


@pytest.mark.parametrize(
    "sampling, logits", [(GREEDY, None), (SEEDED, None), (SEEDED, PENALIZED)], ids=["greedy", "seeded", "penalized"]
)
def test_a_decode_row_of_three_tokens_returns_what_three_single_steps_do(fresh, sampling, logits):
    """Teacher forcing: a row feeding [last token, the next two tokens single steps chose] samples
    exactly those steps' tokens, position j as the step at sample count + j, and writes their KV."""
    free = list(range(fresh.kv_cache.num_pages - 1, 0, -1))
    single, wide = _Request(PROMPT, 0, slot=0), _Request(PROMPT, 0, slot=1)
    starts = (
        []
        if logits is None
        else [
            SlotStart(slot=r.slot, prompt_ids=PROMPT, min_tokens_banned=[2], params=RequestParams(logits=logits))
            for r in (single, wide)
        ]
    )
    _run(fresh, [(single, PROMPT, 1), (wide, PROMPT, 1)], free, step=0, sampling=sampling, starts=starts)
    logprobs = [_run(fresh, [(single, single.output[-1:], 1)], free, sampling=sampling).logprobs for _ in range(3)]
    result = _run(fresh, [(wide, single.output[:3], 3)], free, sampling=sampling)
    assert wide.output == single.output
    assert logits is None or single.output == [40, 40, 40, wide.output[-1]] != [40] * 4
    positions = range(len(PROMPT), len(PROMPT) + 3)
    for a, b in zip(_kv(fresh, wide, positions), _kv(fresh, single, positions)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if logits is not None:
        assert result.logprob_rows == [0, 1, 2]
        assert [lp.top_ids for lp in result.logprobs] == [lp[0].top_ids for lp in logprobs]
        for lp, (ref,) in zip(result.logprobs, logprobs):
            assert lp.token_id == ref.token_id and lp.logprob == pytest.approx(ref.logprob, abs=1e-5)


def test_rows_of_three_mixed_with_single_decodes_and_prefill_chunks(fresh):
    """Rows of 3 beside a one-token decode and prefill chunks; the second row of 3 starts with
    FUTURE_TOKEN, fed the last token of the first."""
    decoding, chunked = [31, 37, 41], [43, 47, 53, 59, 61]
    expected = generate_greedy(fresh, [PROMPT], 7)[0]
    expected_decode = generate_greedy(fresh, [decoding], 2)[0]
    expected_chunked = generate_greedy(fresh, [chunked], 1, chunk=3)[0]
    free = list(range(fresh.kv_cache.num_pages - 1, 0, -1))
    wide, single, prefill = _Request(PROMPT, 0, slot=3), _Request(decoding, 0, slot=0), _Request(chunked, 0, slot=2)
    _run(fresh, [(single, decoding, 1), (wide, PROMPT, 1)], free, step=0)
    _run(fresh, [(single, single.output[-1:], 1), (wide, expected[:3], 3), (prefill, chunked[:3], 0)], free)
    assert single.output == expected_decode and wide.output == expected[:4] and prefill.output == []
    _run(fresh, [(prefill, chunked[3:], 1), (wide, [FUTURE_TOKEN, *expected[4:6]], 3)], free, step=2)
    assert prefill.output == expected_chunked and wide.output == expected


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda b: setattr(b, "sample_lens", [4]),  # more positions than tokens fed
        lambda b: setattr(b, "sample_lens", [2]),  # a prefill chunk samples at most its last token
    ],
)
def test_sample_lens_beyond_the_rules_are_rejected(runner, corrupt, monkeypatch):
    monkeypatch.setattr(model_runner, "DEBUG_CHECKS", True)
    _, batch = _prefill([[5, 6, 7]], runner.page_size)
    corrupt(batch)
    with pytest.raises(ValueError, match="sample_lens"):
        runner.execute(batch)


def test_future_token_only_first_in_a_row(runner, monkeypatch):
    monkeypatch.setattr(model_runner, "DEBUG_CHECKS", True)
    _, batch = _prefill([[5, 6, 7]], runner.page_size)
    batch.input_ids[1] = FUTURE_TOKEN
    with pytest.raises(ValueError, match="FUTURE_TOKEN"):
        runner.execute(batch)


def _serve(runner, requests, max_tokens, drafts=None):
    """Run (prompt, sampling, logits) requests through the scheduler on `runner` to the end; with
    `drafts` (rid -> its tokens of an earlier run), each decoding request is given the next two of
    them as a draft before every step. Returns (rid -> tokens, steps)."""
    sched = Scheduler(
        SchedulerConfig(max_running_requests=4, prefill_budget=8, kv_capacity_tokens=256, page_size=4),
        eos_token_ids=(2,),
    )
    outputs: dict[str, list[int]] = {}
    for i, (prompt, sampling, logits) in enumerate(requests):
        stop = StopParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(f"r{i}", prompt, RequestParams(sampling=sampling, stop=stop, logits=logits))
        outputs[f"r{i}"] = []
    steps = 0
    while sched.has_unfinished():
        for rid, tokens in outputs.items():
            room = max_tokens - len(tokens) - 2  # a draft row stays below the limit
            if drafts is not None and tokens and room > 0:
                sched.set_draft(rid, drafts[rid][len(tokens) : len(tokens) + min(2, room)])
        out = sched.step(runner)
        for rid, token in out.new_tokens:
            outputs[rid].append(token)
        steps += 1
    return outputs, steps


def test_scheduler_drafts_of_the_models_own_tokens_change_no_output(fresh):
    """Through the scheduler: drafts that are what the model generates run rows of 3 (fewer steps)
    beside chunked prefills, and every request's tokens stay those of the plain run."""
    requests = [
        (PROMPT, GREEDY, PLAIN_LOGITS),
        ([31, 37, 41, 43, 47, 53, 59, 61, 67, 71], SEEDED, PLAIN_LOGITS),
        ([12, 13], SEEDED, LogitsParams(frequency_penalty=0.7, repetition_penalty=1.2, min_tokens=4)),
    ]
    plain, plain_steps = _serve(fresh, requests, 10)
    drafted, drafted_steps = _serve(fresh, requests, 10, drafts=plain)
    assert drafted == plain and drafted_steps < plain_steps
