"""Preemption for real: the scheduler and the worker in one process (`OfflineEngine`) with a KV pool
too small for the requests' outputs. Preempted requests are recomputed from prompt + generated
tokens, and greedy output stays token-identical to each request run alone."""

from __future__ import annotations

import pytest
from test_model_equivalence import transformers_greedy_text

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig

PROMPTS = ["w5 w9 w11", "w7", "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15", "w100 w200 w300 w31 w32 w33", "w40 w41"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True, seed=5)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each prompt's greedy tokens from transformers, one request at a time."""
    return transformers_greedy_text(model_dir, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("page_size, capacity", [(1, 48), (16, 48)])
@pytest.mark.parametrize("policy", ["prefill-first", "mixed", "fixed"])
def test_preempted_greedy_requests_equal_their_solo_outputs(
    model_dir, alone, policy, page_size, capacity, prefix_cache
):
    # 5 slots and a 5 % estimate admit every request at once; 5 x (prompt + 24) tokens outgrow the pool.
    # With the prefix cache, a recompute starts on the pages it left cached.
    config = ServerConfig(
        model=str(model_dir),
        policy=policy,
        prefill_budget=8,
        max_running_requests=5,
        page_size=page_size,
        kv_capacity_tokens=capacity,
        kv_reserve_ratio=0.05,
        disable_prefix_cache=not prefix_cache,
    )
    engine = OfflineEngine(config)
    completions = engine.generate(
        [
            request(f"r{i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": NEW_TOKENS, "ignore_eos": True})
            for i, p in enumerate(PROMPTS)
        ]
    )
    assert engine.preemptions > 0
    assert [c.token_ids for c in completions] == alone
    assert all(c.finish_reason == "length" for c in completions)
    sched = engine.scheduler
    cached = sched.kv.cache.num_pages if prefix_cache else 0
    assert sched.kv_used_tokens == 0 and sched.allocator.num_free + cached == sched.num_kv_pages
    assert prefix_cache or sched.kv.hit_tokens == 0


def test_seeded_sampling_is_unchanged_by_preemption(model_dir):
    """A seeded request's stream continues its sample count across a recompute: same tokens."""
    seeded = [
        request(
            f"s{i}",
            prompt=p,
            sampling={"temperature": 0.9, "seed": 100 + i},
            stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        for i, p in enumerate(PROMPTS)
    ]
    roomy = OfflineEngine(
        ServerConfig(
            model=str(model_dir), page_size=4, kv_capacity_tokens=1024, max_running_requests=5, prefill_budget=64
        )
    )
    tight = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            page_size=4,
            kv_capacity_tokens=48,
            max_running_requests=5,
            prefill_budget=64,
            kv_reserve_ratio=0.05,
        )
    )
    expected = [c.token_ids for c in roomy.generate(seeded)]
    assert [c.token_ids for c in tight.generate(seeded)] == expected
    assert roomy.preemptions == 0 and tight.preemptions > 0


@pytest.mark.slow
def test_default_model_with_preemptions_equals_solo_runs():
    chats = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Name three colours.",
        "Explain what a CPU cache is.",
        "Give me a synonym for happy.",
        "Count from one to ten.",
    ]
    engine = OfflineEngine(
        ServerConfig(
            model=DEFAULT_MODEL, page_size=16, kv_capacity_tokens=256, max_running_requests=6, kv_reserve_ratio=0.05
        )
    )
    requests = [
        request(
            f"c{i}", messages=[{"role": "user", "content": c}], sampling={"temperature": 0}, stop={"max_tokens": 40}
        )
        for i, c in enumerate(chats)
    ]
    together = engine.generate(requests)
    assert engine.preemptions > 0
    solo = [engine.generate([r])[0] for r in requests]  # alone, a request is never preempted
    assert [c.token_ids for c in together] == [c.token_ids for c in solo]
    assert [c.text for c in together] == [c.text for c in solo]
