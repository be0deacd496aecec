"""The default model (SmolLM2-135M-Instruct from its Q4_1 GGUF, served in the file's blocks): teacher-forced
over a fixed text its top-1 token agrees with transformers' de-quantized fp32 run at >= 99 % of the positions
(the kernels round the activations to int8 blocks, as llama.cpp does), greedy chats agree where the
reference is sure, and a sanity answer. Slow-ish (a 135M model on CPU) but part of the suite."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy

from batchserve.kernels.quant_blocks import BlockParts
from batchserve.procs.engine import OfflineEngine, request
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig
from batchserve.shared.gguf_convert import transformers_source
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
    runner = ModelRunner(
        DEFAULT_MODEL, device="cpu", page_size=16, kv_capacity_tokens=4096, max_running_requests=8, quantization="none"
    )
    return model_dir, tokenizer, [list(p) for p in prompts], runner


def _reference():
    from transformers import AutoModelForCausalLM

    source, kwargs = transformers_source(resolve_model(DEFAULT_MODEL))
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs).eval()


TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books, which "
    "had been copied by hand for centuries, could now be produced in hundreds of identical copies. Within fifty "
    "years presses were at work in more than two hundred cities across Europe, and the price of a book fell so "
    "far that students, merchants and craftsmen could own them. Scholars argue about how much the press changed "
    "the way people thought, but few doubt that it spread new ideas faster than any invention before it."
)


def test_default_model_keeps_its_blocks_and_agrees_with_the_dequantized_model(default_model):
    _, tokenizer, _, runner = default_model
    assert isinstance(runner.model.layers[0].qkv.weight, BlockParts)
    ids = tokenizer.encode(TEXT)
    engine = OfflineEngine(
        ServerConfig(
            model=DEFAULT_MODEL,
            kv_capacity_tokens=4096,
            prefill_budget=128,
            max_running_requests=4,
            quantization="none",
        )
    )
    [done] = engine.generate(
        [request("t", prompt=TEXT, sampling={"temperature": 0}, stop={"max_tokens": 1}, logits={"prompt_logprobs": 1})]
    )
    ours = torch.tensor([e.top_ids[0] for e in done.prompt_logprobs])
    with torch.inference_mode():
        expected = _reference()(torch.tensor([ids])).logits[0, :-1].argmax(-1)
    agreement = (ours == expected).float().mean().item()
    assert len(ids) > 100 and agreement >= 0.99, agreement


def test_default_model_greedy_chats_agree_where_the_reference_is_sure(default_model):
    """Each chat's greedy tokens equal transformers' (de-quantized) up to the first step whose top two logits
    are within 0.5 of each other, where the int8 activations may tip it either way."""
    _, _, prompts, runner = default_model
    reference = _reference()
    got = generate_greedy(runner, prompts, NEW_TOKENS, chunk=16, arrival_gap=2)
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt + tokens])
        with torch.inference_mode():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2)
        for i, token in enumerate(_until_eos(tokens, runner.eos_token_ids)):
            if float(top2.values[i, 0] - top2.values[i, 1]) < 0.5:
                break
            assert token == int(top2.indices[i, 0]), (i, tokens)


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
