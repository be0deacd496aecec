"""Hugging Face quantized folders (AWQ, GPTQ, FP8: `procs.worker.hf_quantized`) served in GGUF blocks: tiny Llama
folders are quantized here, in numpy, by each format's published packing (AutoAWQ's GEMM order, AutoGPTQ's rows of
nibbles and v1's zero - 1, float8 times a scale per block / channel / tensor), each beside a plain fp32 twin holding
the format's reference de-quantization (w = (q - zero) * scale; w = fp8 * scale). The repacked blocks de-quantize
to the reference (Q4_0 exactly, Q4_1 within the fp16 rounding of m = -zero * scale, Q8_0 within its own rounding);
the model greedy-decodes the twin's tokens wherever the twin's top two logits are apart (teacher-forced), and
exactly the twin's when the blocks are de-quantized at load; what is not served is refused naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from greedy_where_sure import assert_greedy_where_sure
from model_batches import generate_greedy
from safetensors.torch import load_file, save_file
from test_gguf_blocks import MARGIN, NEW_TOKENS, TINY, _prompts

from batchserve.kernels import native
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight
from batchserve.procs.worker import hf_quantized_tensors
from batchserve.procs.worker.gguf_tensors import BlockTensor
from batchserve.procs.worker.loader import iter_checkpoint, load_model_config
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.model import ModelLoadError, ModelSpec

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: the 8 nibbles of a word, low bits first, hold these columns
FP8_MAX = 448.0  # float8_e4m3fn's largest


class Layer(NamedTuple):
    """A weight quantized by a format: its checkpoint tensors, the format's de-quantization of them (fp32), and
    |zero * scale| of each value (int4; the Q4_1 bound's size)."""

    parts: dict[str, torch.Tensor]
    reference: np.ndarray
    zero_scale: np.ndarray | None = None


Quantizer = Callable[[str, np.ndarray], Layer]

# ---------------------------------------------------------------------------------------------
# The formats, written from their documentation (not from the loader)


def int4_groups(w: np.ndarray, group: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [out, in], zero [out, groups], scale fp16 [out, groups]) of w [out, in]: min-max per group, or
    symmetric (zero 8, scale max|w| / 7) as GPTQ's sym=True."""
    out, fan_in = w.shape
    g = w.reshape(out, fan_in // group, group)
    if symmetric:
        scale = (np.abs(g).max(-1) / 7).astype(np.float16)
        zero = np.full(scale.shape, 8.0)
    else:
        low, high = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = ((high - low) / 15).astype(np.float16)
        zero = np.clip(np.round(-low / scale.astype(np.float32)), 0, 15)
    q = np.clip(np.round(g / scale[..., None].astype(np.float32)) + zero[..., None], 0, 15)
    return q.reshape(out, fan_in).astype(np.uint32), zero.astype(np.uint32), scale


def int4_layer(parts: dict[str, np.ndarray], q: np.ndarray, zero: np.ndarray, scale: np.ndarray) -> Layer:
    """The layer and the formats' de-quantization: (q - zero) * scale per group, in fp32."""
    group = q.shape[1] // zero.shape[1]
    z = np.repeat(zero.astype(np.float32), group, axis=1)
    s = np.repeat(scale.astype(np.float32), group, axis=1)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}
    return Layer(tensors, (q.astype(np.float32) - z) * s, np.abs(z * s))


def pack_words(values: np.ndarray, order: list[int]) -> np.ndarray:
    """values [rows, cols] (< 16) as int32 [rows, cols / 8]: nibble i (bits 4i..4i+3) of word k holds column
    8 k + order[i]."""
    rows, cols = values.shape
    v = values.astype(np.uint32).reshape(rows, cols // 8, 8)[:, :, order]
    return np.bitwise_or.reduce(v << (4 * np.arange(8, dtype=np.uint32)), axis=-1).view(np.int32)


def awq_layer(group: int) -> Quantizer:
    """AutoAWQ's GEMM packing: qweight [in, out / 8] and qzeros [groups, out / 8] in `AWQ_PACK_ORDER`, scales
    [groups, out]; zeros stored as they are."""

    def quantize(name: str, w: np.ndarray) -> Layer:
        q, zero, scale = int4_groups(w, group, symmetric=False)
        layer = name.removesuffix(".weight")
        packed = {"qweight": pack_words(q.T, AWQ_PACK_ORDER), "qzeros": pack_words(zero.T, AWQ_PACK_ORDER)}
        return int4_layer({f"{layer}.{k}": v for k, v in {**packed, "scales": scale.T}.items()}, q, zero, scale)

    return quantize


def gptq_layer(group: int, symmetric: bool, v1: bool, g_idx: bool = True) -> Quantizer:
    """AutoGPTQ's packing: qweight [in / 8, out], nibble i of row r holding input 8 r + i; qzeros [groups, out / 8],
    low bits first, v1 storing zero - 1; scales [groups, out]; g_idx [in] (group -1: one group per row)."""

    def quantize(name: str, w: np.ndarray) -> Layer:
        fan_in = w.shape[1]
        size = group if group > 0 else fan_in
        q, zero, scale = int4_groups(w, size, symmetric)
        assert not v1 or zero.min() >= 1  # v1 cannot store a zero of 0
        rows = q.T.reshape(fan_in // 8, 8, -1) << (4 * np.arange(8, dtype=np.uint32))[None, :, None]
        parts = {
            "qweight": np.bitwise_or.reduce(rows, axis=1).view(np.int32),
            "qzeros": pack_words(zero.T - int(v1), list(range(8))),
            "scales": scale.T,
        }
        if g_idx:
            parts["g_idx"] = (np.arange(fan_in) // size).astype(np.int32)
        layer = name.removesuffix(".weight")
        return int4_layer({f"{layer}.{k}": v for k, v in parts.items()}, q, zero, scale)

    return quantize


def fp8_layer(kind: str, static_inputs: bool = False) -> Quantizer:
    """float8_e4m3fn weights and fp32 scales: per 128 x 128 `block` (`weight_scale_inv`, DeepSeek / Qwen3-FP8), or
    per `channel` / `tensor` (`weight_scale`, compressed-tensors); `static_inputs`: an `input_scale` too."""

    def quantize(name: str, w: np.ndarray) -> Layer:
        out, fan_in = w.shape
        if kind == "block":
            padded = np.zeros((-(-out // 128) * 128, -(-fan_in // 128) * 128), np.float32)
            padded[:out, :fan_in] = np.abs(w)
            scale = padded.reshape(padded.shape[0] // 128, 128, -1, 128).max(axis=(1, 3)) / FP8_MAX
            full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:out, :fan_in]
        else:
            scale = (np.abs(w).max(1, keepdims=True) if kind == "channel" else np.abs(w).max()) / FP8_MAX
            full = np.broadcast_to(scale, w.shape)
        scale, full = np.asarray(scale, np.float32), full.astype(np.float32)
        fp8 = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
        layer = name.removesuffix("weight")
        parts = {
            name: fp8,
            layer + ("weight_scale_inv" if kind == "block" else "weight_scale"): torch.from_numpy(scale),
        }
        if static_inputs:  # activation scales: ignored by the loader (activations stay fp32)
            parts[layer + "input_scale"] = torch.tensor(0.02)
        return Layer(parts, fp8.float().numpy() * full)

    return quantize


def ct_config(strategy: str) -> dict:
    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    inputs = dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
        "ignore": ["lm_head"],
    }


def gptq_config(group: int, sym: bool, v1: bool, **more) -> dict:
    fmt = "gptq" if v1 else "gptq_v2"
    return dict(quant_method="gptq", bits=4, group_size=group, sym=sym, desc_act=False, checkpoint_format=fmt, **more)


AWQ_CONFIG = dict(quant_method="awq", bits=4, zero_point=True, version="GEMM", modules_to_not_convert=["lm_head"])
FP8_CONFIG = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
# name: (quantizer, quantization_config, the GGUF block type the layers are kept in)
FORMATS: dict[str, tuple[Quantizer, dict, str]] = {
    "awq-g128": (awq_layer(128), {**AWQ_CONFIG, "group_size": 128}, "Q4_1"),
    "awq-g32": (awq_layer(32), {**AWQ_CONFIG, "group_size": 32}, "Q4_1"),
    "gptq-sym-v1": (gptq_layer(128, True, True), gptq_config(128, True, True), "Q4_0"),
    "gptq-asym-v1-g64": (gptq_layer(64, False, True), gptq_config(64, False, True), "Q4_1"),
    "gptq-asym-v2-whole-rows": (gptq_layer(-1, False, False, g_idx=False), gptq_config(-1, False, False), "Q4_1"),
    "fp8-block": (fp8_layer("block"), FP8_CONFIG, "Q8_0"),
    "ct-fp8-channel": (fp8_layer("channel", static_inputs=True), ct_config("channel"), "Q8_0"),
    "ct-fp8-tensor": (fp8_layer("tensor"), ct_config("tensor"), "Q8_0"),
}


def is_linear(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight")


class Twins(NamedTuple):
    quantized: Path  # the folder quantized
    plain: Path  # its twin of fp32 reference weights
    zero_scale: dict[str, np.ndarray]  # an int4 weight's |zero * scale| per value


def write_twins(source: Path, out: Path, quantize: Quantizer, config: dict) -> Twins:
    """`source` quantized by `quantize` with `config`, and with the reference de-quantized weights."""
    twins = Twins(out / "quantized", out / "plain", {})
    tensors = load_file(source / "model.safetensors")
    for folder in twins[:2]:
        shutil.copytree(source, folder)
    quantized, plain = dict(tensors), dict(tensors)
    for name in [n for n in tensors if is_linear(n)]:
        layer = quantize(name, tensors[name].numpy())
        del quantized[name]
        quantized.update(layer.parts)
        plain[name] = torch.from_numpy(np.ascontiguousarray(layer.reference, dtype=np.float32))
        if layer.zero_scale is not None:
            twins.zero_scale[name] = layer.zero_scale
    save_file(quantized, twins.quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, twins.plain / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    (twins.quantized / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    return twins


@pytest.fixture(scope="module")
def twins(tiny_model_dir, tmp_path_factory) -> Callable[[str], Twins]:
    made: dict[str, Twins] = {}

    def get(fmt: str, arch: dict = TINY) -> Twins:
        key = json.dumps([fmt, arch], sort_keys=True)
        if key not in made:
            quantize, config, _ = FORMATS[fmt]
            made[key] = write_twins(tiny_model_dir(**arch), tmp_path_factory.mktemp(fmt), quantize, config)
        return made[key]

    return get


# ---------------------------------------------------------------------------------------------
# The blocks against the reference


def bound(kind: str, reference: np.ndarray, zero_scale: np.ndarray | None) -> np.ndarray:
    """How far a block type's value may lie from the reference: Q4_0 not at all; Q4_1 the fp16 rounding of
    m = -zero * scale (half an ulp: 2^-11 of |m|, or 2^-25 among fp16's subnormals); Q8_0 half its step (its
    32-value block's max / 127) plus its fp16 scale's rounding (2^-11 of it, over up to 127 steps); each plus
    fp32's rounding of the sum."""
    fp32 = np.abs(reference) * 2.0**-23
    if kind == "Q4_0":
        return np.zeros_like(reference)
    if kind == "Q4_1":
        assert zero_scale is not None
        return zero_scale * 2.0**-11 + 2.0**-25 + fp32
    amax = np.abs(reference).reshape(reference.shape[0], -1, 32).max(-1, keepdims=True)
    step = np.broadcast_to(amax * (0.5 / 127 + 2.0**-11) + 127 * 2.0**-25, (*amax.shape[:2], 32))
    return step.reshape(reference.shape) + fp32


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_repacked_blocks_dequantize_to_the_formats_reference(fmt, twins, monkeypatch):
    """Every linear layer's blocks (de-quantized by gguf-py) lie within the block type's bound of the reference;
    read as fp32 (CUDA, int8, experts) it is the reference itself; two ranks' shares are the whole's blocks.
    Repacked 16 or 32 rows at a time (the chunks of a large layer)."""
    monkeypatch.setattr(hf_quantized_tensors, "CHUNK", 32 * 256)
    folders = twins(fmt)
    kind = FORMATS[fmt][2]
    got = dict(iter_checkpoint(folders.quantized))
    want = load_file(folders.plain / "model.safetensors")
    assert set(got) == set(want)  # qweight / qzeros / scales / g_idx / *_scale(_inv) / input_scale hidden
    worst = 0.0
    for name in [n for n in want if is_linear(n)]:
        weight, reference = got[name], want[name].numpy()
        assert isinstance(weight, BlockTensor) and weight.kind.name == kind
        assert weight.get_shape() == list(reference.shape)
        assert torch.equal(weight[:], want[name])
        values = dequantize(weight.blocks().data.numpy(), GGMLQuantizationType[kind])
        err, limit = np.abs(values - reference), bound(kind, reference, folders.zero_scale.get(name))
        assert (err <= limit).all(), (name, float((err - limit).max()))
        worst = max(worst, float((err / np.where(limit > 0, limit, 1)).max()))
        _check_rank_shares(weight)
    print(f"{fmt}: {kind}, largest error {worst:.3f} of the bound")


def _check_rank_shares(weight: BlockTensor) -> None:
    """Two tensor-parallel ranks' shares (rows of a column layer, block-aligned columns of a row layer) are
    the whole weight's blocks."""
    whole = weight.blocks().data
    out, fan_in = weight.get_shape()
    assert torch.equal(weight.blocks(rows=slice(out // 2, out)).data, whole[out // 2 :])
    half = weight.blocks(cols=slice(fan_in // 2, fan_in))
    assert torch.equal(half.data, whole[:, whole.shape[1] // 2 :]) and half.in_features == fan_in // 2


# ---------------------------------------------------------------------------------------------
# The model


def _runner(model_dir: Path, **kwargs) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", dtype="float32", page_size=4, kv_capacity_tokens=1024, **kwargs)


@pytest.mark.skipif(not native.available(), reason="the blocks run in the C kernels")
@pytest.mark.parametrize("fmt", ["awq-g128", "gptq-sym-v1", "fp8-block"])
def test_kept_in_blocks_greedy_tokens_are_the_twins_where_it_is_sure(fmt, twins):
    """Teacher-forced (each reference step's prefix a prompt of its own): wherever the twin's top two logits are
    further apart than the kernels' activation rounding can move them (test_gguf_blocks' MARGIN), the same token."""
    folders = twins(fmt)
    runner = _runner(folders.quantized, quantization="none")
    layer = runner.model.layers[0]
    qkv = layer.qkv.weight
    assert isinstance(qkv, BlockParts) and {p.kind.name for p in qkv.parts} == {FORMATS[fmt][2]}
    assert isinstance(layer.mlp.down.weight, BlockWeight) and runner.model.fuse_decode_layers
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folders.plain, dtype=torch.float32).eval()
    assert_greedy_where_sure(runner, reference, _prompts(), NEW_TOKENS, MARGIN)


@pytest.mark.parametrize("fmt", ["awq-g32", "gptq-asym-v2-whole-rows", "ct-fp8-channel"])
def test_where_blocks_are_not_kept_the_model_is_its_twin(fmt, twins):
    """At a dtype the block kernels do not run (bfloat16 here, as on CUDA) the folder's weights are read as the
    reference values themselves: every token is the plain twin's at that dtype. At float32, auto keeps blocks."""
    folders = twins(fmt)
    bf16 = {"dtype": "bfloat16", "page_size": 4, "kv_capacity_tokens": 1024}
    runner = ModelRunner(folders.quantized, device="cpu", **bf16)
    assert isinstance(runner.model.layers[0].qkv.weight, torch.Tensor)
    prompts = _prompts()
    twin = ModelRunner(folders.plain, device="cpu", **bf16)
    assert generate_greedy(runner, prompts, NEW_TOKENS) == generate_greedy(twin, prompts, NEW_TOKENS)
    if native.available():
        assert isinstance(_runner(folders.quantized).model.layers[0].qkv.weight, BlockParts)


@pytest.mark.parametrize("fmt", ["fp8-block", "awq-g32"])
def test_a_mixture_of_experts_serves_its_quantized_experts_de_quantized(fmt, twins):
    """Qwen3-MoE quantized experts (one tensor per expert, as published): the experts read as fp32 (exactly the
    reference), the attention kept in blocks at float32; where no blocks are kept (bfloat16), every token is the
    twin's."""
    folders = twins(fmt, dict(arch="qwen3_moe"))
    prompts = [p[:20] for p in _prompts()]
    bf16 = {"dtype": "bfloat16", "page_size": 4, "kv_capacity_tokens": 1024}
    assert generate_greedy(ModelRunner(folders.quantized, device="cpu", **bf16), prompts, 6) == generate_greedy(
        ModelRunner(folders.plain, device="cpu", **bf16), prompts, 6
    )
    if native.available():
        assert isinstance(_runner(folders.quantized).model.layers[0].qkv.weight, BlockParts)


@pytest.mark.skipif(not native.available(), reason="the blocks run in the C kernels")
def test_tensor_parallel_ranks_repack_their_shares_and_give_tp1s_logits(twins):
    """Two ranks of an AWQ folder (whose output rows a column layer splits inside packed words): each repacks
    its rows, or its columns on block boundaries, and the all-reduced logits are one rank's (the ranks' partial
    sums round differently, which may move an activation's int16 rounding: test_gguf_blocks' bound)."""
    from test_tensor_parallel import ENGINE, step_batches, step_logits

    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig

    quantized = twins("awq-g128").quantized
    tp2 = OfflineEngine(ServerConfig(model=str(quantized), tensor_parallel_size=2, quantization="none", **ENGINE))
    try:
        with tp2.direct_runner() as runner:
            o = runner.model.layers[0].o.weight
            assert isinstance(o, BlockWeight) and (o.kind.name, o.out_features, o.in_features) == ("Q4_1", 256, 128)
            got = step_logits(runner, step_batches(runner.vocab_size, runner.page_size))
    finally:
        tp2.close()
    tp1 = _runner(quantized, quantization="none")
    want = step_logits(tp1, step_batches(tp1.vocab_size, tp1.page_size))
    assert all((g - w).abs().max().item() <= 1e-3 for g, w in zip(got, want))  # 1.3e-4 measured


# ---------------------------------------------------------------------------------------------
# Refusals


def _configured(source: Path, out: Path, config: dict) -> Path:
    shutil.copytree(source, out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    return out


@pytest.mark.parametrize(
    "config,message",
    [
        ({**gptq_config(128, True, True), "bits": 3}, r"quant_method 'gptq' in \S+config\.json\) has bits 3: served"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"'bitsandbytes' in \S+\) is not supported: served"),
        ({**AWQ_CONFIG, "group_size": 128, "version": "gemv"}, r"'awq' in \S+\) has version 'gemv' \(its own packing"),
        ({**AWQ_CONFIG, "group_size": 100}, r"'awq' in \S+\) has group_size 100: served"),
        ({**ct_config("channel"), "format": "pack-quantized"}, r"'compressed-tensors' in \S+\) has format 'pack-q"),
        ({"quant_method": "mxfp4"}, r"'mxfp4' in \S+\) is not supported: .* mxfp4 only as gpt-oss's experts"),
    ],
)
def test_a_method_or_setting_not_served_is_refused_in_one_line(config, message, tiny_model_dir, tmp_path):
    folder = _configured(tiny_model_dir(**TINY), tmp_path / "refused", config)
    with pytest.raises(ModelLoadError, match=message) as refused:
        load_model_config(ModelSpec.resolve(folder))
    assert "\n" not in str(refused.value)


def test_a_desc_act_checkpoint_whose_g_idx_reorders_the_groups_is_refused(twins, tmp_path):
    """desc_act (act-order): each input's group is g_idx's, which a block of 32 inputs cannot follow."""
    folder = _configured(twins("gptq-sym-v1").quantized, tmp_path / "act-order", gptq_config(128, True, True))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    g_idx = "model.layers.1.mlp.down_proj.g_idx"
    tensors[g_idx] = tensors[g_idx][torch.randperm(512, generator=torch.Generator().manual_seed(0))].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"down_proj\.g_idx: a desc_act \(act-order\) checkpoint whose g_idx"):
        _runner(folder)
