"""Greedy tokens from ModelRunner are identical to transformers' `generate` (fp32, CPU) on tiny
random-weight Llama / Qwen2 / Qwen3 / Mistral models, however the batch is cut: one packed prefill,
chunked prefill, prefills mixed into other requests' decodes, page size 1 and 16; with the C
kernels (the default where they build) and with torch alone."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy

from batchserve.procs.worker.model_runner import ModelRunner

NEW_TOKENS = 32
PROMPT_LENS = (7, 1, 19, 12, 30)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
MODELS = {
    "llama": dict(arch="llama"),
    "llama-rope-llama3": dict(arch="llama", rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-biases": dict(arch="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "mistral": dict(arch="mistral"),  # transformers' default sliding window, longer than the context
}
SCHEDULES = {
    "packed": dict(),
    "chunked5": dict(chunk=5),
    "mixed": dict(chunk=8, arrival_gap=3),
}


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def transformers_greedy_text(model_dir, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """`transformers_greedy` for text prompts, tokenized by the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return transformers_greedy(model_dir, [tokenizer.encode(p) for p in prompts], max_new_tokens)


def transformers_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run all tokens without suppressing EOS (min_new_tokens would)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
            assert out.shape[1] == len(prompt) + max_new_tokens
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    cache = {}

    def get(name: str):
        if name not in cache:
            spec = dict(MODELS[name])
            model_dir = tiny_model_dir(**spec)
            prompts = _prompts(320)
            cache[name] = (model_dir, prompts, transformers_greedy(model_dir, prompts, NEW_TOKENS))
        return cache[name]

    return get


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(references, model, schedule, page_size):
    model_dir, prompts, expected = references(model)
    runner = ModelRunner(
        model_dir, device="cpu", dtype="float32", page_size=page_size, kv_capacity_tokens=2048, max_running_requests=8
    )
    got = generate_greedy(runner, prompts, NEW_TOKENS, **SCHEDULES[schedule])
    assert got == expected


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_torch_only_path_matches_transformers(references, model, monkeypatch):
    """Where the C kernels cannot be built (no compiler, or BATCHSERVE_NATIVE_KERNELS=0) every op
    runs in torch: the same tokens."""
    from batchserve.kernels import native

    model_dir, prompts, expected = references(model)
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.library.cache_clear()
    try:
        runner = ModelRunner(
            model_dir, device="cpu", dtype="float32", page_size=4, kv_capacity_tokens=2048, max_running_requests=8
        )
        assert runner.attention.name == "torch"
        got = generate_greedy(runner, prompts, NEW_TOKENS, **SCHEDULES["mixed"])
    finally:
        monkeypatch.delenv(native.DISABLE_ENV)
        native.library.cache_clear()
    assert got == expected


def test_eos_and_sizes_from_config(tiny_model_dir):
    runner = ModelRunner(
        tiny_model_dir("qwen2"),
        device="cpu",
        kv_capacity_tokens=100,
        page_size=16,
        max_running_requests=4,
        max_context=128,
    )
    assert runner.eos_token_ids == (2,)
    assert runner.vocab_size == 320
    assert runner.kv_capacity_tokens == 112  # 100 tokens rounded up to 7 pages of 16; dummy page excluded
    assert runner.page_size == 16
    assert runner.max_context == 128
    assert runner.kv_cache.page_table.shape == (4, 8)


def assert_last_token_logits_close(model_dir, runner: ModelRunner) -> list[list[int]]:
    """The runner's logits of a packed batch of prompts' last tokens within 1e-4 of transformers' (fp32);
    the prompts."""
    from model_batches import _plan, _Request
    from transformers import AutoModelForCausalLM

    prompts = _prompts(320, seed=2)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    requests = [_Request(p, 0, slot=i) for i, p in enumerate(prompts)]
    batch = _plan(
        0, [(r, r.prompt, True) for r in requests], runner.page_size, list(range(runner.kv_cache.num_pages - 1, 0, -1))
    )
    runner.kv_cache.apply_page_table_updates(batch.page_table_slots, batch.page_table_cols, batch.page_table_pages)
    with torch.inference_mode():
        logits = runner.forward_logits(batch)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    return prompts


@pytest.mark.parametrize("model", list(MODELS))
def test_last_token_logits_close_to_transformers(tiny_model_dir, model):
    """Beyond argmax: the logits themselves agree (fp32) for a packed batch of prompts."""
    model_dir = tiny_model_dir(**MODELS[model])
    assert_last_token_logits_close(
        model_dir, ModelRunner(model_dir, device="cpu", page_size=4, kv_capacity_tokens=512, max_running_requests=8)
    )


def test_mistral_window_as_long_as_the_context_matches_transformers(tiny_model_dir):
    """A sliding window no shorter than the served context is full attention: transformers' tokens."""
    model_dir = tiny_model_dir("mistral", sliding_window=64)
    prompts = _prompts(320)
    expected = transformers_greedy(model_dir, prompts, NEW_TOKENS)
    assert max(map(len, prompts)) + NEW_TOKENS <= 64
    runner = ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        page_size=4,
        kv_capacity_tokens=1024,
        max_running_requests=8,
        max_context=64,
    )
    assert generate_greedy(runner, prompts, NEW_TOKENS, **SCHEDULES["mixed"]) == expected


def test_every_architecture_runs_through_the_registry(tiny_model_dir):
    """The registry is the one list of architectures, every one covered by the test models, each class
    reading its own config; anything else is refused, naming them."""
    from batchserve.procs.worker.loader import load_model_config
    from batchserve.procs.worker.models import ARCHITECTURES, model_class
    from batchserve.procs.worker.models.llama import LlamaModel
    from batchserve.shared.model import ModelLoadError, ModelSpec
    from batchserve.shared.pooling import HEADLESS_ARCHITECTURES

    archs = (
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
        "phi3",
        "gemma2",
        "gemma3",
        "gemma3_mm",
        "gpt_oss",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
    )
    # the multimodal Qwen3.5 checkpoints run their text model's class (test_hybrid_models builds one)
    text_of_multimodal = {
        "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    }
    # the pooling runner's models without an LM head: headless decoders run their ForCausalLM's class
    # (tests/test_pooling_engine.py), encoders their own (tests/test_pooling_encoders.py)
    generative = {name: cls for name, cls in ARCHITECTURES.items() if name not in HEADLESS_ARCHITECTURES}
    assert {ARCHITECTURES[name] for name in ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")} == {
        ARCHITECTURES[name]
        for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    }
    specs = [ModelSpec.resolve(tiny_model_dir(arch)) for arch in archs]
    assert [spec.architecture for spec in specs] == [a for a in generative if a not in text_of_multimodal]
    assert all(issubclass(model_class(name), LlamaModel) for name in generative)
    assert all(ARCHITECTURES[mm] is ARCHITECTURES[text] for mm, text in text_of_multimodal.items())
    assert len(set(generative.values())) == len(generative) - len(text_of_multimodal)
    configs = [load_model_config(spec) for spec in specs]
    assert [c.qk_norm for c in configs] == [
        "none",
        "none",
        "head",
        "none",
        "none",
        "none",
        "head",
        "projection",
        "none",
        "none",
        "head",
        "head",
        "none",
        "head",
        "head",
        "head",
    ]
    assert [c.moe is not None for c in configs] == [False] * 4 + [True] * 4 + [False] * 4 + [True, True, False, True]
    with pytest.raises(
        ModelLoadError,
        match="supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "MistralForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3MoeForCausalLM, OlmoeForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, "
        "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, GptOssForCausalLM, "
        "Qwen3NextForCausalLM, Qwen3_5ForCausalLM",
    ):
        model_class("GPT2LMHeadModel")
