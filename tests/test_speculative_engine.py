"""Speculative decoding for real (`--speculative ngram` and `--speculative draft`): the scheduler and
the worker in one process (`OfflineEngine`) on tiny random models. Verification keeps only what plain
decoding would have sampled, so every greedy output (penalties, logit_bias, min_tokens, logprobs,
grammars too) must be token-identical with it on and off, with preemptions too; and drafts must
really have been proposed and accepted. Seeded sampling draws the very same tokens with either
method (a seeded draft draws with the model's own noise); an unseeded request's draft-model tokens go
through rejection sampling (`test_rejection_sampler.py`).

The draft model here is the served model itself (it agrees with it: most drafts are accepted) or
another random model (it does not: most are rejected)."""

from __future__ import annotations

import json

import pytest

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig

# Repetitive prompts: a random model's greedy output soon loops, and prompt lookup finds the loop.
PROMPTS = [
    "w5 w9 w11 w5 w9 w11 w5 w9",
    "w7",
    "w3 w4 w5 w6 w7 w8 w9 w10 w3 w4 w5 w6",
    "w100 w200 w300 w31 w32 w33",
    "w40 w41 w40 w41 w40",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True, seed=5)


METHODS = ["ngram", "draft"]


def engine(model_dir, speculative: str, **overrides) -> OfflineEngine:
    """`speculative` "draft": the draft model is `overrides["draft_model"]`, by default the model itself."""
    config = dict(
        model=str(model_dir),
        page_size=4,
        kv_capacity_tokens=2048,
        prefill_budget=32,
        max_running_requests=5,
        speculative=speculative,
        num_speculative_tokens=4,
        ngram_min=1,
    )  # single-token matches too: more drafts, right and wrong
    if speculative == "draft":
        config["draft_model"] = str(model_dir)
    eng = OfflineEngine(ServerConfig(**{**config, **overrides}))
    # Every draft with a token accepted pays here: whether one pays on a tiny model is its probed step times'
    # call (a step costs ~0.3 ms), which a loaded machine can swing past 1, and then no request drafts at all.
    # The break-even share itself: test_step_cost.py, test_speculative_scheduler.py.
    eng.scheduler.planner.cost = None
    return eng


def requests(sampling: dict, logits: dict | None = None, n: int = NEW_TOKENS, **fields):
    return [
        request(
            f"r{i}",
            prompt=p,
            sampling=sampling,
            stop={"max_tokens": n, "ignore_eos": True},
            logits=logits or {},
            **fields,
        )
        for i, p in enumerate(PROMPTS)
    ]


def both(model_dir, reqs, method: str = "ngram", **overrides):
    plain = engine(model_dir, "off", **{k: v for k, v in overrides.items() if k != "draft_model"})
    spec = engine(model_dir, method, **overrides)
    return plain.generate(reqs), spec.generate(reqs), spec


def assert_same(plain, spec) -> None:
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
    assert [c.text for c in spec] == [c.text for c in plain]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy", ["mixed", "prefill-first", "fixed"])
def test_greedy_output_is_unchanged_and_drafts_are_accepted(model_dir, policy, method):
    plain, spec, eng = both(model_dir, requests({"temperature": 0}), method, policy=policy)
    assert_same(plain, spec)
    assert eng.accepted_tokens > 0 and eng.draft_tokens >= eng.accepted_tokens
    assert eng.scheduler.kv_used_tokens == 0
    if method == "draft":  # the model drafting for itself: nearly every draft token is right
        assert eng.accepted_tokens > 0.9 * eng.draft_tokens


@pytest.mark.parametrize("method", METHODS)
def test_one_request_alone_is_unchanged(model_dir, method):
    plain, spec, eng = both(model_dir, requests({"temperature": 0})[:1], method, max_running_requests=1)
    assert_same(plain, spec)
    assert eng.accepted_tokens > 0


def test_a_draft_model_that_disagrees_changes_no_greedy_token(model_dir, tiny_model_dir):
    """Another random model drafts: its tokens are mostly rejected (rolled back), the output is the same."""
    other = tiny_model_dir("llama", with_tokenizer=True, seed=6)
    plain, spec, eng = both(model_dir, requests({"temperature": 0}), "draft", draft_model=str(other))
    assert_same(plain, spec)
    assert eng.draft_tokens > 0 and eng.accepted_tokens < 0.5 * eng.draft_tokens
    assert eng.scheduler.kv_used_tokens == 0


def test_seeded_sampling_with_a_draft_model_draws_plain_decodings_tokens(model_dir, tiny_model_dir):
    """A seeded request's draft draws with the noise the model samples the same position with, and is
    verified by an exact match: its tokens are plain decoding's, whatever the draft (one that agrees
    gets most drafts accepted, one that does not few)."""
    reqs = [
        request(
            f"s{i}",
            prompt=p,
            sampling={"temperature": 0.9, "top_p": 0.95, "seed": 10 + i},
            stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        for i, p in enumerate(PROMPTS)
    ]
    for draft, least in ((model_dir, 0.9), (tiny_model_dir("llama", with_tokenizer=True, seed=6), 0.0)):
        plain, spec, eng = both(model_dir, reqs, "draft", draft_model=str(draft))
        assert_same(plain, spec)
        assert eng.draft_tokens > 0 and eng.accepted_tokens >= least * eng.draft_tokens


def test_unseeded_sampling_with_a_draft_model_accepts_by_rejection_sampling(model_dir, tiny_model_dir):
    """Unseeded sampled requests verify a draft model's tokens by rejection sampling (its distribution
    is checked in test_rejection_sampler.py): a draft that is the model itself is accepted nearly
    always; one that disagrees mostly not; every request still gets its tokens."""
    reqs = requests({"temperature": 0.8})
    for draft, accepted in (
        (model_dir, lambda a, d: a > 0.9 * d),
        (tiny_model_dir("llama", with_tokenizer=True, seed=6), lambda a, d: a < 0.5 * d),
    ):
        eng = engine(model_dir, "draft", draft_model=str(draft))
        done = eng.generate(reqs)
        assert all(len(c.token_ids) == NEW_TOKENS for c in done)
        assert eng.draft_tokens > 0 and accepted(eng.accepted_tokens, eng.draft_tokens)
        assert eng.scheduler.kv_used_tokens == 0


def test_a_draft_model_must_share_the_vocabulary(model_dir, tiny_model_dir):
    from batchserve.shared.model import ModelLoadError

    other = tiny_model_dir("llama", with_tokenizer=True, seed=6, vocab_size=300)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        engine(model_dir, "draft", draft_model=str(other))


def test_seeded_sampling_draws_the_same_tokens(model_dir):
    """A seeded position's noise is a function of (seed, sample count): verification keeps exactly the
    positions plain decoding would have sampled, so the stream is the same one."""
    reqs = [
        request(
            f"s{i}",
            prompt=p,
            sampling={"temperature": 0.7, "seed": 10 + i},
            stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        for i, p in enumerate(PROMPTS)
    ]
    plain, spec, eng = both(model_dir, reqs)
    assert_same(plain, spec)
    assert eng.draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "logits",
    [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.6, "presence_penalty": 0.4},
        {"logit_bias": {"10": -100.0, "11": 5.0}},
        {"min_tokens": 30},
    ],
    ids=["repetition", "frequency-presence", "logit-bias", "min-tokens"],
)
def test_logits_processing_sees_exactly_the_accepted_tokens(model_dir, logits, method):
    plain, spec, eng = both(model_dir, requests({"temperature": 0}, logits), method)
    assert_same(plain, spec)
    assert eng.draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_logprobs_are_those_of_the_accepted_tokens(model_dir, method):
    plain, spec, eng = both(model_dir, requests({"temperature": 0}, {"logprobs": 2}, n=24), method)
    assert_same(plain, spec)
    for p, s in zip(plain, spec):
        assert len(s.logprobs) == len(s.token_ids)
        for a, b in zip(p.logprobs, s.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert eng.accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_preempted_speculative_requests_are_unchanged(model_dir, page_size, method):
    """A pool too small for every output: requests are preempted and recomputed from their kept tokens."""
    reqs = requests({"temperature": 0}, n=24)
    plain = engine(model_dir, "off").generate(reqs)
    tight = engine(
        model_dir, method, page_size=page_size, kv_capacity_tokens=64, kv_reserve_ratio=0.05, prefill_budget=8
    )
    assert_same(plain, tight.generate(reqs))
    assert tight.preemptions > 0 and tight.accepted_tokens > 0
    assert tight.scheduler.kv_used_tokens == 0


@pytest.mark.parametrize("method", METHODS)
def test_a_request_can_opt_out(model_dir, method):
    eng = engine(model_dir, method)
    eng.generate(requests({"temperature": 0}, speculative=False))
    assert eng.draft_tokens == 0
    eng.generate(requests({"temperature": 0}))
    assert eng.draft_tokens > 0


@pytest.fixture(scope="module")
def byte_model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)


@pytest.mark.parametrize("method", METHODS)
def test_grammar_constrained_output_is_unchanged_and_valid(byte_model_dir, method):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["ok", "colour", "n"],
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
    }
    reqs = [
        request(
            f"g{i}",
            prompt=p,
            sampling={"temperature": 0},
            stop={"max_tokens": 60},
            constraint={"kind": "json_schema", "spec": json.dumps(schema)},
        )
        for i, p in enumerate(["the quick brown fox", '{"ok": true, "colour": "red", "n": 1}', "abc abc abc"])
    ]
    reqs += [
        request(
            "regex",
            prompt="yes no yes no yes",
            sampling={"temperature": 0},
            stop={"max_tokens": 40},
            constraint={"kind": "regex", "spec": "((yes|no) ){6}"},
        )
    ]
    plain, spec, eng = both(byte_model_dir, reqs, method, kv_capacity_tokens=4096, prefill_budget=64)
    assert_same(plain, spec)
    for c in spec[:3]:
        value = json.loads(c.text)
        assert set(value) == {"ok", "colour", "n"} and value["colour"] in ("red", "green")
    assert eng.draft_tokens > 0
