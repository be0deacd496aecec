"""Workload generation of `batchserve bench`: seeding, lengths, prompts, Poisson arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchserve.loadtests.runner import LoadPoint
from batchserve.loadtests.targets import Plan
from batchserve.loadtests.workload import (
    CHAT_MIX,
    WORDS,
    LengthRange,
    TokenizerPromptBuilder,
    WordPromptBuilder,
    chat_workload,
    poisson_arrivals,
    random_workload,
)


def test_same_seed_same_workload_different_seed_different():
    ins, outs = LengthRange(8, 64), LengthRange(4, 32)
    a = random_workload(20, ins, outs, seed=1, builder=WordPromptBuilder())
    b = random_workload(20, ins, outs, seed=1, builder=WordPromptBuilder())
    c = random_workload(20, ins, outs, seed=2, builder=WordPromptBuilder())
    assert a == b
    assert a != c
    assert chat_workload(15, 3, WordPromptBuilder()) == chat_workload(15, 3, WordPromptBuilder())
    assert chat_workload(15, 3, WordPromptBuilder()) != chat_workload(15, 4, WordPromptBuilder())


def test_random_lengths_stay_in_range_and_word_prompts_have_the_asked_length():
    specs = random_workload(200, LengthRange(5, 9), LengthRange(3, 3), seed=0, builder=WordPromptBuilder())
    assert {s.output_len for s in specs} == {3}
    assert {s.input_len for s in specs} == set(range(5, 10))  # inclusive range, all values drawn
    for s in specs:
        words = s.prompt.split()
        assert len(words) == s.input_len and set(words) <= set(WORDS)


def test_chat_mix_draws_every_kind_within_its_ranges():
    specs = chat_workload(400, seed=0, builder=WordPromptBuilder())
    seen = set()
    for s in specs:
        kind = next(k for k in CHAT_MIX if s.prompt.startswith(k.instruction))
        seen.add(kind.name)
        assert kind.input_len.low <= s.input_len <= kind.input_len.high
        assert kind.output_len.low <= s.output_len <= kind.output_len.high
    assert seen == {k.name for k in CHAT_MIX}


def test_tokenizer_prompts_are_about_the_asked_token_length(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    builder = TokenizerPromptBuilder(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    for n in (1, 17, 100):
        prompt = builder.build(rng, n)
        ids = tok.encode(prompt).ids
        assert len(ids) == n
        assert 1 not in ids  # special tokens are never drawn


def test_length_range_parsing():
    assert LengthRange.parse("128", "x") == LengthRange(128, 128)
    assert LengthRange.parse("16:64", "x") == LengthRange(16, 64)
    for bad in ("0", "9:3", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="x"):
            LengthRange.parse(bad, "x")


def test_poisson_arrivals_have_the_asked_rate_and_are_seeded():
    rate = 20.0
    times = poisson_arrivals(4000, rate, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # exponential gaps: standard deviation equals the mean
    assert np.std(gaps) == pytest.approx(1 / rate, rel=0.08)
    assert poisson_arrivals(50, rate, seed=7) == times[:50]
    assert poisson_arrivals(50, rate, seed=8) != times[:50]
    assert poisson_arrivals(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_arrivals(5, 0.0, seed=0)


def test_questions_send_no_max_tokens_and_a_seed_each():
    from batchserve.loadtests.client import build_payload
    from batchserve.loadtests.workload import QUESTION_TEMPERATURE, QUESTIONS, questions_workload

    specs = questions_workload(len(QUESTIONS) + 5, seed=0)
    assert specs == questions_workload(len(QUESTIONS) + 5, seed=0) != questions_workload(len(QUESTIONS) + 5, seed=1)
    assert {s.prompt for s in specs} == set(QUESTIONS)  # every question, then cycling
    assert len({s.seed for s in specs}) == len(specs)
    assert all(s.output_len is None and s.temperature == QUESTION_TEMPERATURE for s in specs)
    payload = build_payload(specs[0], "chat", "m")
    assert "max_tokens" not in payload and "ignore_eos" not in payload
    assert payload["seed"] == specs[0].seed and payload["temperature"] == QUESTION_TEMPERATURE
    fixed = build_payload(
        random_workload(1, LengthRange(4, 4), LengthRange(7, 7), 0, WordPromptBuilder())[0], "completions", "m"
    )
    assert fixed["max_tokens"] == 7 and fixed["ignore_eos"] is True and "seed" not in fixed


def test_load_points_get_their_own_prompts():
    """A sweep's points must not resend earlier points' prompts: a prefix-caching server would answer
    them from its cache and flatter the later points."""
    specs = random_workload(5 + 8, LengthRange(4, 8), LengthRange(2, 2), 0, WordPromptBuilder())
    points = [LoadPoint(concurrency=2), LoadPoint(concurrency=4)]
    plan = Plan(specs, [], points, 0, "completions", num_prompts=[5, 8])
    first, second = plan.specs_for(0), plan.specs_for(1)
    assert (len(first), len(second)) == (5, 8)
    assert not {s.prompt for s in first} & {s.prompt for s in second}
    assert list(first) + list(second) == specs
    every = Plan(specs, [], points, 0, "completions")  # no counts: every point runs the whole workload
    assert every.specs_for(0) == every.specs_for(1) == specs


def test_rounds_get_their_own_prompts():
    """`--rounds`: a round must not resend an earlier round's prompts either (the second would be served
    from the prefix cache that the first filled)."""
    specs = random_workload(2 * (3 + 4), LengthRange(4, 8), LengthRange(2, 2), 0, WordPromptBuilder())
    plan = Plan(specs, [], [LoadPoint(concurrency=1), LoadPoint(concurrency=2)], 0, "completions", num_prompts=[3, 4])
    slices = [plan.specs_for(i, r) for r in range(2) for i in range(2)]
    assert [len(s) for s in slices] == [3, 4, 3, 4]
    assert [spec for piece in slices for spec in piece] == specs


def test_editing_prompts_hold_a_passage_and_end_at_eos():
    from batchserve.loadtests.workload import EDITS, editing_workload

    specs = editing_workload(12, seed=0)
    assert specs == editing_workload(12, seed=0) != editing_workload(12, seed=1)
    for spec in specs:
        instruction, passage = spec.prompt.split("\n\n", 1)
        assert instruction in EDITS and len(passage.split()) >= 20
        assert spec.output_len == 2 * len(passage.split()) and spec.stop_at_eos and spec.temperature == 0.0
