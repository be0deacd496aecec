"""The default model (SmolLM2-135M-Instruct from its GGUF): greedy tokens identical to transformers
on chat prompts, and a sanity answer. Slow-ish (a 135M model on CPU) but part of the suite."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy

from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.model import load_tokenizer, resolve_model

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU cache is.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def default_model():
    model_dir = resolve_model(DEFAULT_MODEL)  # converts the GGUF once into the cache dir
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for c in CHATS
    ]
    runner = ModelRunner(DEFAULT_MODEL, device="cpu", page_size=16, kv_capacity_tokens=4096, max_running_requests=8)
    return model_dir, tokenizer, [list(p) for p in prompts], runner


def test_default_model_matches_transformers(default_model):
    from transformers import AutoModelForCausalLM

    model_dir, _, prompts, runner = default_model
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            expected.append(out[0, len(prompt) :].tolist())  # ends at EOS, or after NEW_TOKENS tokens
    got = generate_greedy(runner, prompts, NEW_TOKENS, chunk=16, arrival_gap=2)
    assert [_until_eos(g, runner.eos_token_ids) for g in got] == expected


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def test_default_model_knows_the_capital_of_france(default_model):
    _, tokenizer, prompts, runner = default_model
    [answer] = generate_greedy(runner, prompts[:1], 20)
    text = tokenizer.decode(answer, skip_special_tokens=True)
    assert "Paris" in text, text
    assert runner.eos_token_ids == (tokenizer.eos_token_id,)
