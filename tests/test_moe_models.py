"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random models built from their
transformers configs (fp32, 8 experts, top 2, routers scaled up so that no top-k is a near-tie), in both
checkpoint layouts (one tensor per expert, transformers 5's fused tensors): greedy tokens equal
transformers' at batch 1 and however the batch is cut, with the C kernels and with torch alone, logits
within 1e-4; norm_topk_prob true and false, a shared expert, dense layers between sparse ones, clipped q/k/v.
The defaults a config may leave out are transformers'. Checkpoints and configs the block cannot run are
refused naming the tensor or the field. The C block equals the torch path for a rank's share of the
experts, with biases, and with int8 weights. GGUF files of qwen2moe and qwen3moe (as llama.cpp writes
them) serve the model's tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_batches import generate_greedy
from native_marks import requires_native_kernels
from safetensors.torch import load_file, save_file
from test_model_equivalence import SCHEDULES, _prompts, assert_last_token_logits_close, transformers_greedy
from test_panel_linear import unpacked

from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.model import ModelLoadError

NEW_TOKENS = 24
MODELS = {
    "mixtral": dict(arch="mixtral"),
    "mixtral-fused": dict(arch="mixtral", fused_experts=True),
    "qwen2_moe": dict(arch="qwen2_moe"),  # a shared expert; norm_topk_prob false, transformers' default
    "qwen2_moe-fused-dense-layer": dict(arch="qwen2_moe", fused_experts=True, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen3_moe": dict(arch="qwen3_moe", norm_topk_prob=True),  # as published checkpoints set it
    "qwen3_moe-fused-sparse-step": dict(
        arch="qwen3_moe", fused_experts=True, decoder_sparse_step=2, num_hidden_layers=3
    ),
    "olmoe-clipped": dict(arch="olmoe", clip_qkv=1.5),
    "olmoe-fused": dict(arch="olmoe", fused_experts=True, norm_topk_prob=True),
}


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    cache = {}

    def get(name: str):
        if name not in cache:
            model_dir = tiny_model_dir(**MODELS[name])
            prompts = _prompts(320)
            cache[name] = (model_dir, prompts, transformers_greedy(model_dir, prompts, NEW_TOKENS))
        return cache[name]

    return get


def _runner(model_dir: Path, **kwargs) -> ModelRunner:
    return ModelRunner(
        model_dir, device="cpu", dtype="float32", page_size=4, kv_capacity_tokens=2048, max_running_requests=8, **kwargs
    )


@pytest.mark.parametrize("schedule", ["packed", "mixed"])
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(references, model, schedule):
    model_dir, prompts, expected = references(model)
    runner = _runner(model_dir)
    assert runner.model.fuse_decode_layers  # decode steps in one C call, MoE blocks included
    assert generate_greedy(runner, prompts, NEW_TOKENS, **SCHEDULES[schedule]) == expected


def test_greedy_matches_transformers_at_batch_1(references):
    model_dir, prompts, expected = references("qwen3_moe")
    runner = _runner(model_dir)
    assert [generate_greedy(runner, [p], NEW_TOKENS)[0] for p in prompts[:2]] == expected[:2]


@pytest.mark.parametrize("model", list(MODELS))
def test_torch_only_path_matches_transformers(references, model, monkeypatch):
    """Without the C kernels the experts run on torch._grouped_mm over tokens sorted by expert."""
    from batchserve.kernels import native

    model_dir, prompts, expected = references(model)
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.library.cache_clear()
    try:
        runner = _runner(model_dir)
        assert not runner.model.fuse_decode_layers
        got = generate_greedy(runner, prompts, NEW_TOKENS, **SCHEDULES["mixed"])
    finally:
        monkeypatch.delenv(native.DISABLE_ENV)
        native.library.cache_clear()
    assert got == expected


@pytest.mark.parametrize("model", list(MODELS))
def test_last_token_logits_close_to_transformers(tiny_model_dir, model):
    model_dir = tiny_model_dir(**MODELS[model])
    runner = _runner(model_dir)
    prompts = assert_last_token_logits_close(model_dir, runner)
    # every token went to top_k experts of every sparse layer
    blocks = [layer.mlp for layer in runner.model.layers if hasattr(layer.mlp, "load")]
    assert blocks and all(int(b.load.sum()) == sum(map(len, prompts)) * 2 for b in blocks)


def test_sparse_and_dense_layers_as_the_config_places_them(tiny_model_dir):
    from batchserve.procs.worker.models.layers import GatedMLP
    from batchserve.procs.worker.models.moe import SparseMoeBlock

    layers = _runner(tiny_model_dir(**MODELS["qwen3_moe-fused-sparse-step"])).model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoeBlock, GatedMLP]
    layers = _runner(tiny_model_dir(**MODELS["qwen2_moe-fused-dense-layer"])).model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoeBlock, GatedMLP]
    assert layers[0].mlp.shared is not None


@pytest.mark.parametrize(
    "module,arch_defaults",
    [
        ("mixtral", ["CONFIG_DEFAULTS"]),
        ("qwen_moe", ["QWEN2_MOE_DEFAULTS", "QWEN3_MOE_DEFAULTS"]),
        ("olmoe", ["CONFIG_DEFAULTS"]),
    ],
)
def test_config_defaults_are_transformers(module, arch_defaults):
    """A config.json without a key means what transformers' config class makes of it (never a guess)."""
    import importlib

    import transformers

    classes = {
        "CONFIG_DEFAULTS": {"mixtral": "MixtralConfig", "olmoe": "OlmoeConfig"}.get(module),
        "QWEN2_MOE_DEFAULTS": "Qwen2MoeConfig",
        "QWEN3_MOE_DEFAULTS": "Qwen3MoeConfig",
    }
    mod = importlib.import_module(f"batchserve.procs.worker.models.{module}")
    for name in arch_defaults:
        config_class = getattr(transformers, classes[name])
        fields = {f: getattr(config_class, f, None) for f in getattr(mod, name)}
        assert fields == getattr(mod, name), name  # the class attributes: defaults before __post_init__


# ---------------------------------------------------------------------------------------------
# Refused at load, in one line naming what is wrong


def _edited(src: Path, dst: Path, *, tensors=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        weights = load_file(dst / "model.safetensors")
        tensors(weights)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_a_missing_or_misshapen_expert_tensor_is_named(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3_moe")
    missing = _edited(src, tmp_path / "missing", tensors=lambda w: w.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"^checkpoint lacks tensor model\.layers\.1\.mlp\.experts\.5\.up_proj"):
        _runner(missing)

    def shrink(w):
        name = "model.layers.0.mlp.experts.3.down_proj.weight"
        w[name] = w[name][:, :16].contiguous()

    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight has shape "
        r"\(64, 16\), expected \(64, 32\)",
    ):
        _runner(_edited(src, tmp_path / "misshapen", tensors=shrink))
    fused = tiny_model_dir("mixtral", fused_experts=True)
    with pytest.raises(
        ModelLoadError,
        match=r"mlp\.experts\.gate_up_proj has shape \(7, 96, 64\), expected "
        r"\(8, 96, 64\)",
    ):
        _runner(
            _edited(
                fused,
                tmp_path / "fused",
                tensors=lambda w: w.update(
                    {"model.layers.0.mlp.experts.gate_up_proj": w["model.layers.0.mlp.experts.gate_up_proj"][:7]}
                ),
            )
        )


@pytest.mark.parametrize(
    "field,value", [("scoring_func", "sigmoid"), ("topk_group", 2), ("n_group", 4), ("routed_scaling_factor", 2.5)]
)
def test_a_router_setting_the_block_does_not_implement_is_named(tiny_model_dir, tmp_path, field, value):
    edited = _edited(tiny_model_dir("qwen2_moe"), tmp_path / field, config=lambda raw: raw.update({field: value}))
    with pytest.raises(ModelLoadError, match=f"unsupported MoE router setting {field}={value!r}"):
        _runner(edited)


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_a_quantized_checkpoint_is_refused_by_its_method(tiny_model_dir, tmp_path, arch):
    """AWQ, GPTQ and FP8 folders are served, their experts de-quantized at load (tests/test_hf_quantized.py);
    a method that is not, such as bitsandbytes, is refused by name."""
    nf4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    edited = _edited(tiny_model_dir(arch), tmp_path / arch, config=lambda raw: raw.update(quantization_config=nf4))
    with pytest.raises(ModelLoadError, match=r"quantized checkpoint \(quantization_config quant_method 'bitsandbytes'"):
        _runner(edited)


# ---------------------------------------------------------------------------------------------
# The C block against the torch path


def _random_experts(count: int, hidden: int, inter: int, bias: bool, generator: torch.Generator):
    gate_up = torch.randn(count, 2 * inter, hidden, generator=generator) * 0.2
    down = torch.randn(count, hidden, inter, generator=generator) * 0.2
    biases = (
        (torch.randn(count, 2 * inter, generator=generator), torch.randn(count, hidden, generator=generator))
        if bias
        else (None, None)
    )
    return gate_up, down, biases


@requires_native_kernels
@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("first,count", [(0, 8), (2, 3)])
def test_the_c_block_equals_the_torch_path(first, count, bias, quantization):
    from batchserve.kernels.moe import Experts, NativeMoeBlock, count_load, experts_forward, pack_experts, route
    from batchserve.kernels.panel_linear import pack_panels

    generator = torch.Generator().manual_seed(3)
    experts_total, hidden, inter, top_k, rows = 8, 48, 24, 2, 37
    gate_up, down, (gate_up_bias, down_bias) = _random_experts(count, hidden, inter, bias, generator)
    router = torch.randn(experts_total, hidden, generator=generator)
    router_bias = torch.randn(experts_total, generator=generator) if bias else None  # gpt-oss's router has one
    x = torch.randn(rows, hidden, generator=generator)
    packed = pack_experts(gate_up, down, gate_up_bias, down_bias, first=first, quantization=quantization)
    load = torch.zeros(experts_total, dtype=torch.int64)
    block = NativeMoeBlock(pack_panels(router), router_bias, packed, None, top_k=top_k, renormalize=True, load=load)
    got = block(x)
    if quantization == "int8":  # the reference on the weights the panels stand for
        gate_up = torch.stack([unpacked(packed.gate_up.expert(e)) for e in range(count)])
        down = torch.stack([unpacked(packed.down.expert(e)) for e in range(count)])
    plain = Experts(gate_up, down, gate_up_bias, down_bias, first=first, count=count, intermediate=inter)
    weights, ids = route(torch.nn.functional.linear(x, router, router_bias), top_k, renormalize=True)
    expected = experts_forward(x, ids, weights, plain)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    reference_load = torch.zeros(experts_total, dtype=torch.int64)
    count_load(reference_load, ids)
    assert torch.equal(load, reference_load) and int(load.sum()) == rows * top_k
    assert (got[(ids - first).ge(0).logical_and((ids - first).lt(count)).any(dim=1).logical_not()] == 0).all()


# ---------------------------------------------------------------------------------------------
# GGUF files (llama.cpp's qwen2moe and qwen3moe), through transformers' GGUF loader


@pytest.mark.parametrize("arch,renormalize", [("qwen2_moe", False), ("qwen3_moe", True)])
def test_a_gguf_file_serves_the_models_tokens(tiny_model_dir, tmp_path, monkeypatch, arch, renormalize):
    """The conversion reads what transformers' GGUF loader leaves at its defaults (the experts'
    intermediate sizes) from the file, and writes the experts as fused tensors. llama.cpp's qwen3moe
    always renormalises the top k (transformers says so for GGUF files), as published Qwen3-MoE configs do;
    its qwen2moe never does, as Qwen1.5-MoE's config says."""
    from gguf_files import write_moe_gguf

    from batchserve.shared.model import resolve_model

    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    hf = tiny_model_dir(arch, with_tokenizer="bytes", fused_experts=True, norm_topk_prob=renormalize)
    gguf = write_moe_gguf(hf, tmp_path / f"tiny-{arch}.gguf")
    converted = resolve_model(gguf)
    config = json.loads((converted / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["norm_topk_prob"]) == (32, renormalize)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(converted / "model.safetensors")
    prompts = _prompts(320)
    assert generate_greedy(_runner(converted), prompts, NEW_TOKENS) == transformers_greedy(hf, prompts, NEW_TOKENS)
