"""Gemma 2 and Gemma 3 (Gemma3ForCausalLM, and Gemma3ForConditionalGeneration as its text model) on tiny
random models built from transformers configs: sliding layers (a window of 8) beside global ones, prompts
and outputs that cross the window, attention and final soft-caps small enough to bite (Gemma 2), q/k norms
and the sliding layers' own rope base (Gemma 3). Greedy tokens equal transformers' `generate` at batch 1
however the batch is cut, with and without the C kernels; every position's logits within 1e-4 over chunked
prompts; through the scheduler with cache hits and preemption."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_batches import generate_greedy
from model_references import (
    assert_chunked_logits_close,
    greedy_references,
    run_scheduled,
    scheduled_prompts,
    small_runner,
    torch_only,
)
from test_model_equivalence import SCHEDULES, transformers_greedy, transformers_greedy_text

from batchserve.procs.worker.loader import load_model_config
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.model import ModelLoadError, ModelSpec

NEW_TOKENS = 20
PROMPT_LENS = (25, 4, 13, 9)
TINY = dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
MODELS = {
    "gemma2": dict(arch="gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=2.0, **TINY),
    "gemma2-default-caps": dict(arch="gemma2", query_pre_attn_scalar=16, **TINY),
    "gemma3": dict(arch="gemma3", **TINY),
    "gemma3-rope-scaling": dict(
        arch="gemma3",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        **TINY,
    ),
    # Gemma 3 4B+'s checkpoint: served as its text model, the vision tower's tensors skipped
    "gemma3-multimodal": dict(arch="gemma3_mm", **TINY),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(tiny_model_dir, MODELS, lambda _: _prompts(), NEW_TOKENS)


def test_configs_are_read_as_transformers_reads_them(tiny_model_dir):
    gemma2 = load_model_config(ModelSpec.resolve(tiny_model_dir(**MODELS["gemma2"])))
    assert (gemma2.windows, gemma2.attn_softcap, gemma2.final_softcap) == ((8, 0), 1.0, 2.0)
    assert gemma2.attention_scale == 256**-0.5 and gemma2.norm_offset == 1.0 and gemma2.local_rope is None
    gemma3 = load_model_config(ModelSpec.resolve(tiny_model_dir(**MODELS["gemma3-rope-scaling"])))
    assert (gemma3.attn_softcap, gemma3.final_softcap, gemma3.qk_norm) == (0.0, 0.0, "head")
    assert (gemma3.rope.kind, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 4.0, 100000.0)
    assert (gemma3.local_rope.kind, gemma3.local_rope.theta) == ("default", 1000.0)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(references, model, schedule):
    model_dir, expected = references(model)
    assert generate_greedy(small_runner(model_dir), _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", ["gemma2", "gemma3-rope-scaling"])
def test_sliding_layers_in_rings_match_transformers(references, model, schedule):
    """The sliding layers' KV in rings of 5 pages (20 tokens), which 45-token requests wrap twice."""
    model_dir, expected = references(model)
    runner = small_runner(model_dir, rings=True)
    assert runner.kv_cache.ring_layers == (0,) and runner.kv_cache.pool_pages(0) == 1 + 8 * 5
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


@pytest.mark.parametrize("model", ["gemma2", "gemma3-rope-scaling"])
def test_chunks_longer_than_a_ring_match_transformers(tiny_model_dir, model, monkeypatch):
    """Chunks of 18 after a prefix, longer than a ring (of 7 pages: the window and a row of 16) holds beside
    the window: they read the window before them from the ring and their own k/v beside it, written to the
    ring after (C kernels and torch alike); rows of 11 and 12 after a prefix attend through the ring."""
    model_dir = tiny_model_dir(**MODELS[model])
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (47, 30, 19)]
    expected = transformers_greedy(model_dir, prompts, NEW_TOKENS)

    def runner():
        return small_runner(model_dir, rings=True, ring_step_tokens=16)

    assert runner().kv_cache.ring_pages == 7
    assert generate_greedy(runner(), prompts, NEW_TOKENS, chunk=18, arrival_gap=2) == expected
    with torch_only(monkeypatch):
        assert generate_greedy(runner(), prompts, NEW_TOKENS, chunk=18) == expected


@pytest.mark.parametrize("rings", [False, True])
@pytest.mark.parametrize("model", ["gemma2", "gemma3-rope-scaling"])
def test_torch_only_path_matches_transformers(references, model, rings, monkeypatch):
    model_dir, expected = references(model)
    with torch_only(monkeypatch):
        runner = small_runner(model_dir, rings=rings)
        assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


@pytest.mark.parametrize("rings", [False, True])
@pytest.mark.parametrize("model", ["gemma2", "gemma3-rope-scaling"])
def test_every_position_logits_close_over_chunks(tiny_model_dir, model, rings):
    assert_chunked_logits_close(tiny_model_dir(**MODELS[model]), _prompts()[0], rings=rings)


@pytest.mark.parametrize("full_sliding_kv", [True, False])
def test_scheduled_requests_match_transformers(tiny_model_dir, full_sliding_kv):
    """Chunks shorter than the window, a cached prefix (with every layer's KV kept; rings keep no prefix
    cache), preemption and recompute."""
    model_dir = tiny_model_dir(with_tokenizer=True, **MODELS["gemma2"])
    expected = transformers_greedy_text(model_dir, scheduled_prompts(), NEW_TOKENS)
    got, engine = run_scheduled(model_dir, scheduled_prompts(), NEW_TOKENS, full_sliding_kv=full_sliding_kv)
    assert got == expected and engine.preemptions > 0
    assert engine.runner.kv_cache.ring_layers == (() if full_sliding_kv else (0,))
    if full_sliding_kv:
        assert engine.scheduler.kv.hit_tokens >= 16
    else:
        assert engine.scheduler.kv.cache is None  # a cached prefix would lack the rings' KV


def test_other_activations_are_refused(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "gemma2"
    shutil.copytree(tiny_model_dir(**MODELS["gemma2"]), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_activation": "relu"}))
    with pytest.raises(ModelLoadError, match="unsupported hidden_activation 'relu'"):
        load_model_config(ModelSpec.resolve(model_dir))


def test_a_window_as_long_as_the_context_keeps_the_local_rope(tiny_model_dir):
    """Served at a context no longer than its window, Gemma 3's sliding layers mask nothing, yet rotate
    with their own rope base still (transformers' tokens)."""
    overrides = {**MODELS["gemma3-rope-scaling"], "sliding_window": 64}
    model_dir = tiny_model_dir(**overrides)
    prompts = _prompts()
    expected = transformers_greedy(model_dir, prompts, NEW_TOKENS)
    runner = ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        page_size=4,
        kv_capacity_tokens=2048,
        max_running_requests=8,
        max_context=64,
    )
    assert runner.config.windows == () and runner.config.local_rope_layers == (0,)
    assert generate_greedy(runner, prompts, NEW_TOKENS, **SCHEDULES["mixed"]) == expected


def test_a_row_wider_than_its_rings_is_refused(tiny_model_dir):
    """A ring sized for rows of 8 would lose the window before a row of 12: the step is refused, not run."""
    model_dir = tiny_model_dir(**MODELS["gemma2"])
    with pytest.raises(ValueError, match="a row of 12 tokens overflows the sliding layers' rings of 5 pages"):
        generate_greedy(small_runner(model_dir, rings=True), [list(range(3, 33))], 2, chunk=18)


def test_a_length_following_rope_beside_the_local_one_is_refused(tiny_model_dir, tmp_path):
    """Gemma 3's sliding layers index their own rope by the global rope's rows: a dynamic (or longrope) global
    rope, whose rows follow the length, is refused at load rather than read out of range."""
    model_dir = tmp_path / "gemma3-dynamic"
    shutil.copytree(tiny_model_dir(**MODELS["gemma3"]), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="a rope that follows the length"):
        small_runner(model_dir)
