"""Dynamic NTK rope on a tiny random Llama built from transformers' config: `max_position_embeddings` 32,
factor 2 (served to 64 positions, as vLLM serves it), prompts short of 32 whose outputs cross it and
prompts past it from the start. A key has the frequencies of the length its sequence had when transformers
computed it (a prompt's: the whole prompt's; a later token's: its position + 1), whatever the chunks:
greedy tokens equal transformers' `generate` at batch 1 (a fresh model per prompt: transformers keeps the
longest length it saw between calls) however the batch is cut, with and without the C kernels; through
the scheduler with the prefix cache, which shares a long prompt's keys only with prompts of its length."""

from __future__ import annotations

import json

import pytest
import torch
from model_batches import generate_greedy
from model_references import small_runner, torch_only
from test_model_equivalence import SCHEDULES, transformers_greedy, transformers_greedy_text

from batchserve.kernels.rope import RotaryTables, dynamic_inv_freq, inv_freq
from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig
from batchserve.shared.model import ModelSpec
from batchserve.shared.rope import RopeConfig

NEW_TOKENS = 24
PROMPT_LENS = (20, 40, 9, 33, 31)
DYNAMIC = dict(
    arch="llama",
    max_position_embeddings=32,
    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model_dir = tiny_model_dir(**DYNAMIC)
    return model_dir, [transformers_greedy(model_dir, [prompt], NEW_TOKENS)[0] for prompt in _prompts()]


def test_frequencies_and_served_positions_are_transformers(tiny_model_dir):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_dir = tiny_model_dir(**DYNAMIC)
    rope = RopeConfig.from_hf(json.loads((model_dir / "config.json").read_text()), "config.json")
    assert (rope.kind, rope.factor, rope.dynamic_length, rope.served_positions) == ("dynamic", 2.0, 32, 64)
    assert ModelSpec.resolve(model_dir).context_length == 64
    hf = AutoConfig.from_pretrained(model_dir)
    for length in (1, 32, 33, 40, 64):
        theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, None, seq_len=torch.tensor(length))
        assert torch.equal(dynamic_inv_freq(rope, 16, torch.tensor([length]))[0], theirs), length
    assert torch.equal(inv_freq(rope, 16), ROPE_INIT_FUNCTIONS["dynamic"](hf, None)[0])


def test_rows_follow_the_length_a_key_was_computed_at():
    rope = RopeConfig(kind="dynamic", factor=2.0, max_position_embeddings=32)
    tables = RotaryTables(rope, 16, 64, device=torch.device("cpu"), dtype=torch.float32)
    import numpy as np

    positions = np.array([5, 31, 32, 10, 39, 40, 50], dtype=np.int64)
    prompts = np.array([20, 20, 20, 40, 40, 40, 40])  # a short prompt's tokens, a long one's, later tokens
    rows = tables.rows(positions, prompts)
    assert rows.tolist() == [5, 31, 64 + 32, 10, 64 + 39, 64 + 40, 64 + 50]
    cos, _ = tables.lookup(torch.from_numpy(rows))
    assert torch.equal(cos[0], tables.cos[5]) and torch.equal(cos[6], tables.cos[64 + 50])
    inside = (positions[3] * dynamic_inv_freq(rope, 16, torch.tensor([40]))[0]).cos()  # the long prompt's length
    assert torch.equal(cos[3, :8], inside) and not torch.equal(cos[3], tables.cos[10])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(reference, schedule):
    model_dir, expected = reference
    assert generate_greedy(small_runner(model_dir), _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


def test_torch_only_path_matches_transformers(reference, monkeypatch):
    model_dir, expected = reference
    with torch_only(monkeypatch):
        assert generate_greedy(small_runner(model_dir), _prompts(), NEW_TOKENS, **SCHEDULES["chunked5"]) == expected


def test_preempted_requests_keep_their_frequencies(tiny_model_dir):
    """A recompute feeds the generated tokens as prompt, yet its keys keep the frequencies they first had
    (the client's prompt length, and each later token's position + 1): transformers' tokens still."""
    model_dir = tiny_model_dir(with_tokenizer=True, **DYNAMIC)
    prompts = [" ".join(f"w{10 + i}" for i in range(34)), " ".join(f"w{60 + i}" for i in range(36))]
    expected = [transformers_greedy_text(model_dir, [prompt], 20)[0] for prompt in prompts]
    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            page_size=4,
            max_running_requests=2,
            kv_capacity_tokens=96,
            kv_reserve_ratio=0.05,
            prefill_budget=16,
        )
    )
    rope, lengths = engine.runner.model.rope, set()
    rows = rope.rows
    rope.rows = lambda positions, prompt_lens: lengths.update(prompt_lens.tolist()) or rows(positions, prompt_lens)
    got = [
        c.token_ids
        for c in engine.generate(
            [
                request(f"r{i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": 20, "ignore_eos": True})
                for i, p in enumerate(prompts)
            ]
        )
    ]
    assert got == expected and engine.preemptions > 0
    assert lengths == {len(engine.tokenizer.encode(p)) for p in prompts}  # never a recompute's longer prompt


def test_the_prefix_cache_shares_long_prompts_only_at_their_length(tiny_model_dir):
    """A long prompt's keys follow its length: a longer prompt with the same start computes its own, one of
    the same length reuses them; short prompts share as ever."""
    model_dir = tiny_model_dir(with_tokenizer=True, **DYNAMIC)

    def words(n: int, first: int) -> str:
        return " ".join(f"w{first + i}" for i in range(n))

    rounds = [
        [words(36, 10)],
        [words(36, 10) + " w200"],
        [words(35, 10) + " w201"],
        [words(16, 60)],
        [words(16, 60) + " w202"],
    ]
    expected = [transformers_greedy_text(model_dir, prompts, 8)[0] for prompts in rounds]
    engine = OfflineEngine(
        ServerConfig(model=str(model_dir), page_size=4, max_running_requests=2, kv_capacity_tokens=512)
    )
    kv, got, hits = engine.scheduler.kv, [], []
    for i, prompts in enumerate(rounds):
        before = kv.hit_tokens
        got += [
            c.token_ids
            for c in engine.generate(
                [
                    request(
                        f"r{i}",
                        prompt=prompts[0],
                        sampling={"temperature": 0},
                        stop={"max_tokens": 8, "ignore_eos": True},
                    )
                ]
            )
        ]
        hits.append(kv.hit_tokens - before)
    assert got == expected
    assert hits[1] == 0 and hits[2] >= 32 and hits[4] >= 16  # 37 tokens: its own; 36: the first's; short: shared
