"""Weights quantized at load into GGUF blocks (`--quantization q8_0 | q4_0 | q4_k`), so a checkpoint that is not a
GGUF file runs on the block kernels (`kernels.quant_blocks`) in a quarter to an eighth of fp32's bytes: the
legacy types by gguf-py's quantizer (the maintained one), the k-quants by `kernels.kquant_quantize`.

As llama-quantize does: a layer whose input width is not whole 256-value blocks takes Q5_0 where Q4_K was asked
(Q8_0 for Q6_K), and the LM head takes Q6_K under a 4-bit choice (llama.cpp's Q4_0 and Q4_K_M files keep their
output layer in Q6_K: the logits are what rounding moves most)."""

from __future__ import annotations

import numpy as np
import torch

from batchserve.kernels.kquant_quantize import quantize_kquant_rows
from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockType, BlockWeight

BLOCK_QUANTIZATIONS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}  # --quantization -> block type
_HEAD = {"q4_0": "Q6_K", "q4_k": "Q6_K"}
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama-quantize's, for rows that are not whole 256-value blocks
_CHUNK_ROWS = 4096  # rows quantized at a time: numpy's temporaries stay a few times one chunk


def block_type_for(quantization: str, in_features: int, *, head: bool = False) -> BlockType:
    """The block type `quantization` gives a layer `in_features` wide (the LM head's with `head`)."""
    name = _HEAD.get(quantization, "") if head else ""
    name = name or BLOCK_QUANTIZATIONS[quantization]
    if in_features % BLOCK_TYPES[name].block and name in _FALLBACK:
        name = _FALLBACK[name]
    kind = BLOCK_TYPES[name]
    if in_features % kind.block:
        raise ValueError(
            f"--quantization {quantization}: a layer {in_features} inputs wide is not whole {kind.block}-value "
            f"{kind.name} blocks; serve it with --quantization none or int8"
        )
    return kind


def quantize_weight(weight: torch.Tensor, quantization: str, *, head: bool = False) -> BlockWeight:
    """An [out, in] weight (any float dtype) in the blocks `quantization` gives it."""
    kind = block_type_for(quantization, weight.shape[1], head=head)
    chunks = [_quantize_rows(weight[i : i + _CHUNK_ROWS], kind) for i in range(0, weight.shape[0], _CHUNK_ROWS)]
    return BlockWeight(torch.from_numpy(np.concatenate(chunks)), kind)


def _quantize_rows(rows: torch.Tensor, kind: BlockType) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    w = rows.detach().to(device="cpu", dtype=torch.float32).numpy()
    if kind.block == 256:
        return quantize_kquant_rows(w, kind.name)
    return np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[kind.name]))
