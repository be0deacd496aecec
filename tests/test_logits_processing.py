"""Penalties, logit_bias, min_tokens and logprobs.

On logits: the worker's per-slot state applies each formula exactly as a plain reference does (and
keeps it current token by token). End to end (`OfflineEngine`, tiny model): greedy output with
penalties equals a transformers loop applying the same formulas; prompt logprobs equal transformers'
log-softmax; bans hold; seeded penalized output does not depend on the batch or on preemption.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchserve.procs.engine import OfflineEngine, request
from batchserve.procs.worker.logits_state import SlotLogitsState
from batchserve.procs.worker.sample_rows import SampleRows
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import LogitsParams, RequestParams, SlotStart

VOCAB = 50


def reference_adjust(
    logits: torch.Tensor, params: LogitsParams, prompt: list[int], output: list[int], banned: list[int]
) -> torch.Tensor:
    """The formulas, one token at a time (the order LogitsParams documents)."""
    x = logits.clone().double()
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, b in params.logit_bias.items():
        x[t] = -math.inf if b <= -100 else x[t] + b
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if len(output) < params.min_tokens:
        x[banned] = -math.inf
    return x.float()


def one_each(slots: np.ndarray, counts: np.ndarray) -> SampleRows:
    """One position per row: nothing proposed, so the fed tokens are never read."""
    n = slots.shape[0]
    return SampleRows.build(slots, counts, np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64))


CASES = [
    LogitsParams(frequency_penalty=0.7),
    LogitsParams(presence_penalty=-0.5),
    LogitsParams(repetition_penalty=1.3),
    LogitsParams(repetition_penalty=0.8, frequency_penalty=0.2, presence_penalty=0.4),
    LogitsParams(logit_bias={3: -100.0, 7: 2.5, 11: -1.0}),
    LogitsParams(min_tokens=4, frequency_penalty=0.1),
    LogitsParams(min_tokens=2, logit_bias={9: 100.0}),
]


@pytest.mark.parametrize("params", CASES)
def test_adjusted_rows_equal_the_reference_token_by_token(params):
    torch.manual_seed(1)
    state = SlotLogitsState(4, VOCAB, torch.device("cpu"))
    prompt, output, banned = [1, 2, 2, 5, 9], [5, 6], [0, 9]
    state.start(
        SlotStart(
            slot=3, params=RequestParams(logits=params), prompt_ids=prompt, output_ids=output, min_tokens_banned=banned
        )
    )
    state.start(SlotStart(slot=1))
    rng = np.random.default_rng(1)
    for _ in range(6):
        raw = torch.randn(2, VOCAB) * 3
        logits = raw.clone()
        state.adjust_(logits, one_each(np.array([1, 3]), np.array([0, len(output)])))
        torch.testing.assert_close(logits[0], raw[0], rtol=0, atol=0)
        torch.testing.assert_close(logits[1], reference_adjust(raw[1], params, prompt, output, banned))
        token = int(rng.choice([5, 6, 7, int(rng.integers(0, VOCAB))]))  # repeats, so counts grow
        state.record(one_each(np.array([1, 3]), np.array([0, len(output)])), torch.tensor([4, token]))
        output.append(token)


def test_a_new_request_in_the_slot_starts_clean():
    state = SlotLogitsState(2, VOCAB, torch.device("cpu"))
    biased = LogitsParams(frequency_penalty=1.0, logit_bias={4: -100.0})
    state.start(SlotStart(slot=0, output_ids=[3], params=RequestParams(logits=biased)))
    state.record(one_each(np.array([0]), np.array([1])), torch.tensor([3]))
    state.start(SlotStart(slot=0, params=RequestParams(logits=LogitsParams(presence_penalty=0.5))))
    raw = torch.randn(1, VOCAB)
    logits = raw.clone()
    state.adjust_(logits, one_each(np.array([0]), np.array([0])))
    torch.testing.assert_close(logits, raw)  # nothing generated yet: no count, no old bias


def _tables_of(state: SlotLogitsState, slot: int) -> list[torch.Tensor]:
    tables = state._tables
    return [] if tables is None else [tables.counts[slot], tables.additive[slot], tables.seen[slot]]


@pytest.mark.parametrize("params", CASES)
def test_each_position_of_a_row_sees_the_proposed_tokens_before_it_as_generated(params):
    """A decode row feeding [t0, d1, d2]: position j is adjusted exactly as a single-token step after
    d1 .. dj were generated (same bits), and recording its 3 tokens leaves the state 3 steps leave."""
    torch.manual_seed(2)
    prompt, output, banned = [1, 2, 2, 5, 9], [5, 6], [0, 9]
    start = SlotStart(
        slot=3, params=RequestParams(logits=params), prompt_ids=prompt, output_ids=output, min_tokens_banned=banned
    )
    wide, single = SlotLogitsState(4, VOCAB, torch.device("cpu")), SlotLogitsState(4, VOCAB, torch.device("cpu"))
    for state in (wide, single):
        state.start(start)
        state.start(SlotStart(slot=1, output_ids=[4], params=RequestParams(logits=LogitsParams(frequency_penalty=0.3))))
    t0, proposed, last = 6, [5, 5], 9  # d1 == d2: the count of one token grows twice within the row
    for _ in range(2):
        raw = torch.randn(4, VOCAB) * 3
        # a width-1 row of slot 1, then slot 3's width-3 row
        rows = SampleRows.build(
            np.array([1, 3]), np.array([1, len(output)]), np.array([1, 3]), np.array([8, t0, *proposed])
        )
        logits = raw.clone()
        wide.adjust_(logits, rows)
        expected = raw.clone()
        single.adjust_(expected[:2], one_each(np.array([1, 3]), np.array([1, len(output)])))
        for j, token in enumerate(proposed, start=1):
            single.record(one_each(np.array([3]), np.array([len(output) + j - 1])), torch.tensor([token]))
            single.adjust_(expected[1 + j : 2 + j], one_each(np.array([3]), np.array([len(output) + j])))
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        for j in range(3):
            torch.testing.assert_close(
                logits[1 + j], reference_adjust(raw[1 + j], params, prompt, output + proposed[:j], banned)
            )
        sampled = [*proposed, last]  # the proposals were the model's choices (teacher forcing)
        wide.record(rows, torch.tensor([4, *sampled]))
        single.record(one_each(np.array([1, 3]), np.array([1, len(output) + 2])), torch.tensor([4, last]))
        for a, b in zip(_tables_of(wide, 3) + _tables_of(wide, 1), _tables_of(single, 3) + _tables_of(single, 1)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        output += sampled
        t0 = last


# ---------------------------------------------------------------------------------------------- end to end

PROMPTS = ["w5 w9 w11", "w7 w7 w7 w7", "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15", "w100 w200 w300 w31"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True, seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_penalized_greedy(hf, prompt: str, params: LogitsParams, n: int) -> list[int]:
    model, tokenizer = hf
    ids = tokenizer.encode(prompt)
    output: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids + output])).logits[0, -1].float()
            output.append(int(reference_adjust(logits, params, ids, output, []).argmax()))
    return output


def engine(model_dir, **overrides) -> OfflineEngine:
    config = dict(model=str(model_dir), page_size=4, kv_capacity_tokens=512, prefill_budget=8, max_running_requests=4)
    return OfflineEngine(ServerConfig(**{**config, **overrides}))


def _requests(logits: dict, sampling=None, n=NEW_TOKENS, prompts=PROMPTS, prefix="r"):
    return [
        request(
            f"{prefix}{i}",
            prompt=p,
            sampling=sampling or {"temperature": 0},
            stop={"max_tokens": n, "ignore_eos": True},
            logits=logits,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize(
    "logits",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    ],
    ids=["frequency", "presence", "repetition", "all"],
)
def test_penalized_greedy_equals_transformers_with_the_same_formulas(model_dir, hf, logits):
    params = LogitsParams(**logits)
    expected = [hf_penalized_greedy(hf, p, params, NEW_TOKENS) for p in PROMPTS]
    plain = [c.token_ids for c in engine(model_dir).generate(_requests({}))]
    got = [c.token_ids for c in engine(model_dir).generate(_requests(logits))]
    assert got == expected
    assert got != plain  # the penalty did change something


def test_logit_bias_bans_and_min_tokens_hold_the_stop(model_dir):
    eng = engine(model_dir)
    plain = eng.generate(_requests({}))
    banned = {t for c in plain for t in c.token_ids[:3]}
    biased = eng.generate(
        _requests({"logit_bias": {t: -100.0 for t in banned}}, sampling={"temperature": 1.0, "seed": 3})
    )
    assert all(not banned & set(c.token_ids) for c in biased)
    # The 4th greedy token as a stop token: it ends the request at 4 tokens, unless min_tokens holds it back.
    stop_token = plain[0].token_ids[3]
    stop = {"max_tokens": 30, "stop_token_ids": [stop_token]}
    early = eng.generate([request("s", prompt=PROMPTS[0], sampling={"temperature": 0}, stop=stop)])[0]
    held = eng.generate(
        [request("m", prompt=PROMPTS[0], sampling={"temperature": 0}, stop=stop, logits={"min_tokens": 20})]
    )[0]
    assert len(early.token_ids) <= 4
    assert len(held.token_ids) >= 20 and stop_token not in held.token_ids[:19]
    assert eng.scheduler.kv_used_tokens == 0


def test_logprobs_are_the_models_log_softmax(model_dir, hf):
    model, tokenizer = hf
    eng = engine(model_dir, prefill_budget=5, max_running_requests=1)  # chunked prefill: prompt logprobs cross chunks
    eng.generate(_requests({}, n=2))  # the prompts are now in the prefix cache: prompt logprobs must skip it
    done = eng.generate(_requests({"logprobs": 3, "prompt_logprobs": 2}, n=4, prefix="lp"))
    for prompt, c in zip(PROMPTS, done):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([ids + c.token_ids])).logits[0].float(), dim=-1)
        assert [e.token_id for e in c.prompt_logprobs] == ids[1:]
        for pos, e in enumerate(c.prompt_logprobs):
            assert e.logprob == pytest.approx(ref[pos, ids[pos + 1]].item(), abs=1e-4)
            assert len(e.top_ids) == 2 and e.top_ids[0] == int(ref[pos].argmax())
        for k, e in enumerate(c.logprobs):  # greedy: the chosen token is the top-1
            row = ref[len(ids) - 1 + k]
            assert e.token_id == c.token_ids[k] == e.top_ids[0] == int(row.argmax())
            assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
            torch.testing.assert_close(torch.tensor(e.top_logprobs), row.topk(3).values, atol=1e-4, rtol=0)


def test_seeded_penalized_output_ignores_batch_and_preemption(model_dir):
    logits = {"frequency_penalty": 0.8, "presence_penalty": 0.3, "repetition_penalty": 1.1, "logit_bias": {5: 1.0}}
    sampling = {"temperature": 0.9, "seed": 11}
    solo = [engine(model_dir).generate(_requests(logits, sampling, n=24, prompts=[p]))[0].token_ids for p in PROMPTS]
    crowded = engine(model_dir, kv_capacity_tokens=48, kv_reserve_ratio=0.05, page_size=1)
    together = crowded.generate(_requests(logits, sampling, n=24))
    assert crowded.preemptions > 0
    assert [c.token_ids for c in together] == solo


def test_logit_bias_outside_the_vocabulary_is_refused_naming_it(model_dir):
    from batchserve.shared.errors import Refusal

    eng = engine(model_dir)
    vocab = eng.prompts.vocab_size
    with pytest.raises(Refusal) as info:
        eng.tokenize(request("x", prompt="w1", logits={"logit_bias": {vocab: 1.0}}))
    assert info.value.param == "logit_bias" and str(vocab) in info.value.message
