"""gpt-oss (GptOssForCausalLM) on tiny random models built from transformers' config: attention sinks that
take a real share of each softmax, a sliding layer (a window of 8) beside a global one, yarn over an original
context of 32 that the prompts and outputs cross, a router with a bias, biased experts with gate and up
interleaved and a SwiGLU clamp (limit 1) that bites. Greedy tokens equal transformers' `generate` however
the batch is cut, with and without the C kernels; every position's logits within 1e-4 over chunked prompts;
through the scheduler with cache hits and preemption. MXFP4 checkpoints: de-quantized as transformers
de-quantizes them, and served token-exact against transformers on the de-quantized twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_batches import generate_greedy
from model_references import assert_chunked_logits_close, run_scheduled, scheduled_prompts, small_runner, torch_only
from safetensors.torch import load_file, save_file
from test_model_equivalence import SCHEDULES, transformers_greedy, transformers_greedy_text

from batchserve.kernels.moe import ClampedSwiGLU
from batchserve.procs.worker.loader import load_model_config
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.models import mxfp4
from batchserve.shared.model import ModelLoadError, ModelSpec

NEW_TOKENS = 20
PROMPT_LENS = (25, 4, 13, 9)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
TINY = dict(arch="gpt_oss", sliding_window=8, rope_parameters=YARN, max_position_embeddings=128, swiglu_limit=1.0)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tuple[Path, list[list[int]]]:
    model_dir = tiny_model_dir(**TINY)
    return model_dir, transformers_greedy(model_dir, _prompts(), NEW_TOKENS)


def test_config_is_read_as_transformers_reads_it(tiny_model_dir):
    config = load_model_config(ModelSpec.resolve(tiny_model_dir(**TINY)))
    assert config.windows == (8, 0) and config.attn_sinks and config.qkv_bias and config.o_bias
    rope = config.rope
    assert (rope.kind, rope.factor, rope.original_max_position_embeddings, rope.truncate) == ("yarn", 4.0, 32, False)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.router_bias, moe.sparse_layers) == (8, 2, True, (0, 1))
    assert moe.activation == ClampedSwiGLU(alpha=1.702, limit=1.0)


@pytest.mark.parametrize("rings", [False, True])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(reference, schedule, rings):
    """Every layer's KV kept, or the sliding layer's in rings of 20 tokens that the requests wrap."""
    model_dir, expected = reference
    runner = small_runner(model_dir, rings=rings)
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


@pytest.mark.parametrize("rings", [False, True])
def test_torch_only_path_matches_transformers(reference, monkeypatch, rings):
    model_dir, expected = reference
    with torch_only(monkeypatch):
        runner = small_runner(model_dir, rings=rings)
        assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


@pytest.mark.parametrize("rings", [False, True])
def test_every_position_logits_close_over_chunks(tiny_model_dir, rings):
    assert_chunked_logits_close(tiny_model_dir(**TINY), _prompts()[0], rings=rings)


@pytest.mark.parametrize("full_sliding_kv", [True, False])
def test_scheduled_requests_match_transformers(tiny_model_dir, full_sliding_kv):
    """Chunks shorter than the window, a cached prefix (every layer's KV kept), preemption and recompute."""
    model_dir = tiny_model_dir(with_tokenizer=True, **TINY)
    expected = transformers_greedy_text(model_dir, scheduled_prompts(), NEW_TOKENS)
    got, engine = run_scheduled(model_dir, scheduled_prompts(), NEW_TOKENS, full_sliding_kv=full_sliding_kv)
    assert got == expected and engine.preemptions > 0
    assert engine.scheduler.kv.hit_tokens >= 16 if full_sliding_kv else engine.runner.kv_cache.ring_layers == (0,)


def _random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of a [..., rows, cols] weight: every nibble, scales of 2^-6 .. 2^-2."""
    *rows, cols = shape
    blocks = torch.randint(0, 256, (*rows, cols // 32, 16), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 126, (*rows, cols // 32), generator=generator, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 64), torch.Generator().manual_seed(0))
    ours = mxfp4.dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transposed: [experts, in, out]
    assert ours.shape == (3, 10, 64) and torch.equal(ours, theirs.transpose(1, 2))
    with pytest.raises(ModelLoadError, match="must be uint8"):
        mxfp4.dequantize(blocks.int(), scales)


def _mxfp4_twins(source: Path, quantized: Path, plain: Path) -> None:
    """`quantized`: `source` with each expert weight replaced by random MXFP4 blocks and scales and an mxfp4
    quantization_config, as the released checkpoints are; `plain`: the same weights de-quantized by
    transformers, in its GptOssExperts layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(1)
    tensors = load_file(source / "model.safetensors")
    for out_dir in (quantized, plain):
        shutil.copytree(source, out_dir)
    quantized_tensors, plain_tensors = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, fan_out = tensors[name].shape
        blocks, scales = _random_mxfp4((experts, fan_out, fan_in), generator)
        del quantized_tensors[name]
        quantized_tensors.update({name + "_blocks": blocks, name + "_scales": scales})
        plain_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(quantized_tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain_tensors, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_serves_its_dequantized_weights(tiny_model_dir, tmp_path):
    quantized, plain = tmp_path / "mxfp4", tmp_path / "plain"
    _mxfp4_twins(tiny_model_dir(**TINY), quantized, plain)
    expected = transformers_greedy(plain, _prompts(), NEW_TOKENS)
    assert generate_greedy(small_runner(quantized), _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


def test_other_quantizations_are_refused(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir(**TINY), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ModelLoadError, match="quant_method 'gptq'"):
        load_model_config(ModelSpec.resolve(model_dir))
    with pytest.raises(ModelLoadError, match="--quantization int8"):
        ModelRunner(
            tiny_model_dir(**TINY),
            device="cpu",
            dtype="float32",
            page_size=4,
            kv_capacity_tokens=256,
            max_running_requests=2,
            quantization="int8",
        )


def test_config_defaults_are_transformers():
    """A config.json without a key means what transformers' GptOssConfig makes of it."""
    from transformers import GptOssConfig

    from batchserve.procs.worker.models.gpt_oss import DEFAULT_ROPE, GPT_OSS_DEFAULTS

    fields = {f: getattr(GptOssConfig, f, None) for f in GPT_OSS_DEFAULTS if f != "rope_theta"}
    assert fields == {f: v for f, v in GPT_OSS_DEFAULTS.items() if f != "rope_theta"}
    assert GPT_OSS_DEFAULTS["rope_theta"] == GptOssConfig.default_theta
    assert {**DEFAULT_ROPE, "rope_theta": GptOssConfig.default_theta} == GptOssConfig().rope_parameters
