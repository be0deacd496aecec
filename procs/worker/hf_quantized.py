"""Hugging Face folders quantized by AWQ, GPTQ or FP8 (config.json's `quantization_config`): `scheme_of` reads
what the config says (ModelLoadError, in one line, for what is not served), `quantized_tensors` turns each
quantized linear layer's tensors into `<layer>.weight`, a `procs.worker.hf_quantized_tensors` weight kept in
GGUF blocks on the CPU (Q4_0 / Q4_1 / Q8_0) and de-quantized elsewhere, and hides the tensors it was made of.

A layer is quantized where its tensors are (`X.qweight`; a float8 `X.weight`): those the config leaves
plain (`modules_to_not_convert`, compressed-tensors' `ignore`: embeddings, LM head, routers) are plain
tensors and pass through. gpt-oss's `mxfp4` experts are its own (`procs.worker.models.gpt_oss`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchserve.procs.worker.hf_quantized_tensors import (
    AWQ_ORDER,
    PLAIN_ORDER,
    Fp8Weight,
    Int4Weight,
    shape_of,
    unpack_columns,
)
from batchserve.shared.errors import ModelLoadError
from batchserve.shared.model import read_model_json

SERVED = (
    "served are 4-bit awq (version gemm, zero_point true) and gptq (checkpoint_format gptq or gptq_v2, g_idx in "
    "group order) in groups of a multiple of 32 inputs (gptq: or -1), fp8 and compressed-tensors float-quantized "
    "8-bit float weights (scaled per tensor, channel or block), mxfp4 only as gpt-oss's experts; else serve the "
    "unquantized weights (on the CPU --quantization int8 quantizes them at load)"
)
FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "torch.float8_e4m3fn", "torch.float8_e5m2")
INT4_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class Scheme:
    """What a folder's quantization_config says of its linear layers."""

    method: str  # "awq", "gptq" or "fp8" (compressed-tensors' FP8 included)
    group_size: int = 0  # int4: inputs per group (-1: a whole row)
    zero_offset: int = 0  # GPTQ v1 (AutoGPTQ, optimum) stores zero - 1
    block: tuple[int, int] | None = None  # FP8: the config's block of a scale (rows, columns), if any


def scheme_of(config: Any, where: str) -> Scheme:
    """The scheme of config.json's `quantization_config` (at `where`); ModelLoadError naming the method and
    what is wrong with it, and what is served, for anything else."""
    method = str(config.get("quant_method", "?")) if isinstance(config, dict) else repr(config)
    read = READERS.get(method.lower())
    try:
        if read is None:
            raise ValueError("is not supported")
        return read(config)
    except ValueError as e:
        where_is = f"quantization_config quant_method {method!r} in {where}"
        raise ModelLoadError(f"quantized checkpoint ({where_is}) {e}: {SERVED}") from None


def _bits(config: dict[str, Any]) -> None:
    if config.get("bits") != 4:
        raise ValueError(f"has bits {config.get('bits')!r}")


def _group_size(config: dict[str, Any], whole_row: bool) -> int:
    size = config.get("group_size", 128)
    if isinstance(size, int) and (size > 0 and size % 32 == 0 or whole_row and size == -1):
        return size
    raise ValueError(f"has group_size {size!r}")


def _awq(config: dict[str, Any]) -> Scheme:
    _bits(config)
    if str(config.get("version", "gemm")).lower() != "gemm":  # AutoAWQ writes "GEMM"
        raise ValueError(f"has version {config.get('version')!r} (its own packing)")
    if config.get("zero_point", True) is not True:
        raise ValueError("has zero_point false")
    return Scheme("awq", group_size=_group_size(config, whole_row=False))


def _gptq(config: dict[str, Any]) -> Scheme:
    _bits(config)
    layout = config.get("checkpoint_format") or config.get("format") or "gptq"
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(f"has checkpoint_format {layout!r}")
    if str(config.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ValueError(f"has pack_dtype {config.get('pack_dtype')!r}")
    # v1 stores zero - 1 (AutoGPTQ's packing; kernels add 1 back), gptq_v2 the zero itself
    return Scheme("gptq", group_size=_group_size(config, whole_row=True), zero_offset=int(layout == "gptq"))


def _block(value: Any) -> tuple[int, int]:
    """A config's block of values that share a scale: [rows, columns]."""
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"has a block of {value!r}, not [rows, columns]")
    return int(value[0]), int(value[1])


def _fp8(config: dict[str, Any]) -> Scheme:
    block = config.get("weight_block_size")
    return Scheme("fp8", block=None if block is None else _block(block))


def _compressed_tensors(config: dict[str, Any]) -> Scheme:
    if config.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"has format {config.get('format')!r}")
    for key in ("kv_cache_scheme", "sparsity_config"):
        if config.get(key):
            raise ValueError(f"has a {key}")
    blocks: set[tuple[int, int]] = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ValueError(f"has {weights.get('num_bits')}-bit {weights.get('type')} weights in {name}")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"has weights scaled per {weights.get('strategy')} in {name}")
        if weights["strategy"] == "block":
            blocks.add(_block(weights.get("block_structure")))
    if len(blocks) > 1:
        raise ValueError(f"has blocks of several shapes {sorted(blocks)}")
    return Scheme("fp8", block=next(iter(blocks), None))


READERS: dict[str, Callable[[dict[str, Any]], Scheme]] = {
    "awq": _awq,
    "gptq": _gptq,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
}


def folder_scheme(model_dir: Path) -> Scheme | None:
    """The folder's scheme; None for a folder without a quantization_config, or gpt-oss's MXFP4 one."""
    config = read_model_json(model_dir).get("quantization_config")
    if not config or isinstance(config, dict) and config.get("quant_method") == "mxfp4":
        return None
    return scheme_of(config, str(Path(model_dir) / "config.json"))


def quantized_tensors(model_dir: Path, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`tensors` (the folder's, by name), each quantized linear layer's as one `<layer>.weight`."""
    scheme = folder_scheme(model_dir)
    if scheme is None:
        yield from tensors
        return
    found = dict(tensors)
    if scheme.method == "fp8":
        for name in [n for n, t in found.items() if n.endswith(".weight") and _dtype(t) in FP8_DTYPES]:
            found[name] = _fp8_weight(name, found, scheme)
    else:
        for layer in [n.removesuffix(".qweight") for n in found if n.endswith(".qweight")]:
            found[layer + ".weight"] = _int4_weight(layer, found, scheme)
    yield from found.items()


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype) if isinstance(tensor, torch.Tensor) else str(tensor.get_dtype())


def _int4_weight(layer: str, found: dict[str, Any], scheme: Scheme) -> Int4Weight:
    """Layer `layer`'s qweight, qzeros, scales (and g_idx) taken from `found` as one weight."""
    missing = [f"{layer}.{part}" for part in INT4_PARTS if f"{layer}.{part}" not in found]
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensor {missing[0]} (beside {layer}.qweight)")
    qweight, qzeros, scales = (found.pop(f"{layer}.{part}") for part in INT4_PARTS)
    if _dtype(qweight) not in ("I32", "torch.int32") or _dtype(qzeros) not in ("I32", "torch.int32"):
        raise ModelLoadError(f"checkpoint tensor {layer}.qweight / qzeros: {_dtype(qweight)}, int32 expected")
    gptq = scheme.method == "gptq"
    zeros = unpack_columns(qzeros[...], PLAIN_ORDER if gptq else AWQ_ORDER) + scheme.zero_offset
    scale = scales[...].to(torch.float16)
    zeros = zeros[:, : scale.shape[1]]  # GPTQ pads its packed zeros to whole words
    weight = Int4Weight(layer + ".weight", qweight, zeros, scale, along_input=gptq)
    expected = weight.get_shape()[1] if scheme.group_size == -1 else scheme.group_size
    if weight.group != expected:
        raise ModelLoadError(
            f"checkpoint tensor {layer}.scales: groups of {weight.group} inputs, config.json's group_size {expected}"
        )
    g_idx = found.pop(f"{layer}.g_idx", None)
    g_idx = None if g_idx is None else g_idx[...].long()
    if g_idx is not None and not torch.equal(g_idx, torch.arange(len(g_idx)) // weight.group):
        raise ModelLoadError(
            f"checkpoint tensor {layer}.g_idx: a desc_act (act-order) checkpoint whose g_idx reorders the groups "
            f"is not supported (the blocks need each 32 inputs in one group): quantize with desc_act false"
        )
    return weight


def _fp8_weight(name: str, found: dict[str, Any], scheme: Scheme) -> Fp8Weight:
    """Float8 weight `name` and its scale, taken from `found` as one weight."""
    out, fan_in = shape_of(found[name], name)
    # static activation scales are ignored: activations stay fp32 (the served dtype off the CPU)
    found.pop(name.removesuffix("weight") + "input_scale", None)
    if name + "_scale_inv" in found:  # DeepSeek / Qwen3-FP8: per block, multiplied despite its name
        scale, block = found.pop(name + "_scale_inv")[...].float(), scheme.block or (128, 128)
    elif name + "_scale" in found:
        scale = found.pop(name + "_scale")[...].float()
        if scale.numel() == 1:
            scale, block = scale.reshape(1, 1), (out, fan_in)
        elif scale.numel() == out and scale.reshape(out, -1).shape[1] == 1:
            scale, block = scale.reshape(out, 1), (1, fan_in)
        elif scheme.block is not None:
            block = scheme.block
        else:
            raise ModelLoadError(
                f"checkpoint tensor {name}_scale: shape {list(scale.shape)} is no tensor's or channel's"
            )
    else:
        raise ModelLoadError(f"checkpoint tensor {name} is float8 without {name}_scale_inv or {name}_scale")
    return Fp8Weight(name, found[name], scale, block)
