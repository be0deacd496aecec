"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on tiny random models built from
transformers' configs: three Gated DeltaNet layers, then a full-attention one (and a 1:1 pattern), a 70-token
prompt that crosses the chunked form's 64-token chunks. Greedy tokens equal transformers' `generate` however
the batch is cut (whole prompts, chunks of 5, prefill beside decodes, slots reused), with the C kernels and
without, on padded decode batches; every position's logits within 1e-4 over chunked prompts; the released
multimodal checkpoints serve their text model; through the scheduler with preemption and recompute, the
prefix cache off and speculation refused."""

from __future__ import annotations

import json

import pytest
import torch
from model_batches import generate_greedy
from model_references import (
    chunked_logits,
    greedy_references,
    run_scheduled,
    scheduled_prompts,
    small_runner,
    torch_only,
)
from safetensors.torch import load_file, save_file
from test_model_equivalence import SCHEDULES, transformers_greedy, transformers_greedy_text

from batchserve.kernels import native
from batchserve.kernels.gated_delta import causal_conv1d_step, gated_delta_step
from batchserve.procs.worker.loader import load_model_config
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.model import ModelSpec

NEW_TOKENS = 12
MODELS = {
    "qwen3_next": dict(arch="qwen3_next"),
    "qwen3_5": dict(arch="qwen3_5"),
    "qwen3_5_moe": dict(arch="qwen3_5_moe"),
    "qwen3_5_one_to_one": dict(arch="qwen3_5", layer_types=["linear_attention", "full_attention"] * 2),
}


def _prompts(_name: str = "") -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (70, 4, 13, 9)]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(tiny_model_dir, MODELS, _prompts, NEW_TOKENS)


def test_config_is_read_as_transformers_reads_it(tiny_model_dir):
    config = load_model_config(ModelSpec.resolve(tiny_model_dir(**MODELS["qwen3_next"])))
    assert config.linear_layers == (0, 1, 2) and config.kv_layers == (3,)
    assert config.rope.partial_rotary_factor == 0.25 and config.norm_offset == 1.0 and config.attn_output_gate
    shape = config.recurrent
    assert (shape.conv_dim, shape.conv_kernel, shape.heads, shape.key_dim, shape.value_dim) == (128, 4, 8, 8, 8)
    assert config.moe.shared_expert_intermediate_size == 48 and config.moe.norm_topk_prob


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(references, model, schedule):
    model_dir, expected = references(model)
    assert generate_greedy(small_runner(model_dir), _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


def test_torch_only_and_padded_decode_match_transformers(references, monkeypatch):
    """The C kernels off; decode batches padded to graph sizes (padded rows keep a dummy state)."""
    model_dir, expected = references("qwen3_5")
    with torch_only(monkeypatch):
        assert generate_greedy(small_runner(model_dir), _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected
    runner = ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        page_size=4,
        kv_capacity_tokens=2048,
        max_running_requests=8,
        pad_decode=True,
    )
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_every_position_logits_close_over_chunks(tiny_model_dir, model):
    """Every position's logits over chunks of 5, against transformers in float64: within what float32 allows
    this model: transformers' own float32 logits' distance from its float64 ones (8e-5 to 3e-3 here: the delta
    rule's log-decay sums and triangular solves round more than a plain decoder does) five times over, and
    1e-4. Ours differs from it by how the rows are cut (chunks of 5 against one pass of 64 + 6) and by the
    C kernels' sums; a wrong formula is off by far more."""
    from transformers import AutoModelForCausalLM

    model_dir, prompt = tiny_model_dir(**MODELS[model]), _prompts()[0]
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        single = reference(torch.tensor([prompt])).logits[0].double()
        double = reference.double()(torch.tensor([prompt])).logits[0]
    ours = chunked_logits(small_runner(model_dir), prompt, chunk=5).double()
    allowed = 5 * (single - double).abs().max().item() + 1e-4
    assert (ours - double).abs().max().item() <= allowed


def test_state_pool_is_sized_per_slot_and_counted_in_memory(tiny_model_dir):
    runner = small_runner(tiny_model_dir(**MODELS["qwen3_5"]))
    cache, states = runner.kv_cache, runner.kv_cache.states
    assert len(cache.k) == 1 and states.conv.shape == (3, 9, 128, 3) and states.matrix.shape == (3, 9, 8, 8, 8)
    assert states.bytes_per_request == 3 * (128 * 3 * 4 + 8 * 8 * 8 * 4)
    assert runner.worker_info().recurrent_state_bytes == states.bytes_per_request
    assert cache.memory_bytes == states.memory_bytes + 2 * cache.k[0].numel() * 4


def test_multimodal_checkpoint_serves_its_text_model(tiny_model_dir, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout: the decoder under model.language_model., its config in
    text_config, a vision tower and an MTP head beside it, both skipped."""
    source = tiny_model_dir(**MODELS["qwen3_5"])
    config = json.loads((source / "config.json").read_text())
    tensors = {
        ("model.language_model." + name[len("model.") :] if name.startswith("model.") else name): t
        for name, t in load_file(source / "model.safetensors").items()
    }
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(4, 4)})
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5",
                "text_config": {k: v for k, v in config.items() if k != "architectures"},
                "vision_config": {"depth": 1},
                "tie_word_embeddings": False,
            }
        )
    )
    expected = transformers_greedy(source, _prompts(), NEW_TOKENS)
    assert generate_greedy(small_runner(tmp_path), _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


def test_scheduled_requests_match_transformers(tiny_model_dir):
    """Chunks of 6 (and one cut at the prompt's last full page, where its state is kept), a cache hit (the
    second prompt starts from the first's kept state and cached pages), preemption and recompute."""
    model_dir = tiny_model_dir(with_tokenizer=True, **MODELS["qwen3_next"])
    expected = transformers_greedy_text(model_dir, scheduled_prompts(), 20)
    got, engine = run_scheduled(model_dir, scheduled_prompts(), 20, full_sliding_kv=False)
    assert got == expected and engine.preemptions > 0
    assert engine.scheduler.config.state_snapshots == 4 and engine.scheduler.kv.hit_tokens >= 20


def test_without_state_snapshots_the_prefix_cache_is_off(tiny_model_dir):
    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig

    model_dir = tiny_model_dir(with_tokenizer=True, **MODELS["qwen3_next"])
    engine = OfflineEngine(ServerConfig(model=str(model_dir), disable_prefix_cache=True, kv_capacity_tokens=256))
    assert engine.runner.kv_cache.states.num_snapshots == 0 and not engine.scheduler.config.prefix_cache


def test_speculation_is_refused(tiny_model_dir):
    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig

    model_dir = tiny_model_dir(with_tokenizer=True, **MODELS["qwen3_5"])
    with pytest.raises(ValueError, match="linear-attention layers keep one state per request"):
        OfflineEngine(ServerConfig(model=str(model_dir), speculative="ngram", kv_capacity_tokens=256))


@pytest.mark.skipif(not native.available(), reason="the C kernels are not built on this machine")
def test_c_decode_step_equals_the_torch_step_in_place_on_the_pool():
    """The C kernel against transformers' recurrent arithmetic (`gated_delta_step`): outputs and the states
    of the rows' slots; other slots untouched."""
    generator = torch.Generator().manual_seed(0)
    rows, key_heads, value_heads, dk, dv = 5, 2, 6, 16, 8
    mixed = torch.randn(rows, 2 * key_heads * dk + value_heads * dv, generator=generator)
    g, beta = (
        -torch.rand(rows, value_heads, generator=generator) * 3,
        torch.rand(rows, value_heads, generator=generator),
    )
    pool = torch.randn(9, value_heads, dk, dv, generator=generator)
    slots = torch.tensor([7, 0, 3, 8, 1])
    q, k, v = mixed.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=1)
    expected, states = gated_delta_step(
        q.view(rows, key_heads, dk), k.view(rows, key_heads, dk), v.view(rows, value_heads, dv), g, beta, pool[slots]
    )
    untouched = pool[[2, 4, 5, 6]].clone()
    got = native.gated_delta_decode(mixed, g, beta, pool, slots, key_heads)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], states, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[2, 4, 5, 6]], untouched)


@pytest.mark.skipif(not native.available(), reason="the C kernels are not built on this machine")
def test_c_convolution_step_equals_the_torch_step_in_place_on_the_pool():
    generator = torch.Generator().manual_seed(1)
    rows, channels, taps = 4, 24, 4
    x = torch.randn(rows, channels + 5, generator=generator)[:, :channels]  # rows strided, as a split leaves them
    weight, pool = (
        torch.randn(channels, taps, generator=generator),
        torch.randn(6, channels, taps - 1, generator=generator),
    )
    slots = torch.tensor([5, 0, 2, 3])
    expected, windows = causal_conv1d_step(x, weight, pool[slots])
    got = native.causal_conv1d_decode(x, weight, pool, slots)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[slots], windows)
