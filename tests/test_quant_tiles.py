"""The block linear layer's many-rows path (`kernels/csrc/quant_linear.c`: from TILE_MIN_ROWS rows, a prefill
chunk, the weight is de-quantized a tile at a time into fp32 panels for the panel kernel): bit for bit the fp32
panel kernel on the de-quantized weight, for every block type, across tile edges, with strided rows and a bias."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from kquant_blocks import quantize_kquant_rows
from native_marks import requires_native_kernels

from batchserve.kernels.panel_linear import pack_panels
from batchserve.kernels.quant_blocks import BLOCK_TYPES, TILE_MIN_ROWS, BlockWeight

pytestmark = requires_native_kernels


def quantized(name: str, rows: int, k: int, rng: np.random.Generator) -> BlockWeight:
    w = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    data = quantize_kquant_rows(w, name) if name.endswith("_K") else quants.quantize(w, GGMLQuantizationType[name])
    return BlockWeight(torch.from_numpy(np.ascontiguousarray(data)), BLOCK_TYPES[name])


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_many_rows_are_the_dequantized_weights_panel_product(name: str) -> None:
    """53 outputs (tiles of 32: the last short, its second panel part padding) and 512 inputs: the same bits
    as the fp32 panel kernel on the de-quantized weight; one row fewer takes the int16 dots (other bits)."""
    rng = np.random.default_rng(7)
    weight = quantized(name, 53, 512, rng)
    panels = pack_panels(weight.dequantize())
    wide = torch.from_numpy(rng.standard_normal((TILE_MIN_ROWS + 5, 520)).astype(np.float32))
    x, bias = wide[:, 3:515], torch.from_numpy(rng.standard_normal(53).astype(np.float32))
    assert torch.equal(weight(x, bias), panels(x, bias)), name
    few = x[: TILE_MIN_ROWS - 1]
    assert not torch.equal(weight(few, bias), panels(few, bias)), name
    torch.testing.assert_close(weight(few, bias), panels(few, bias), rtol=1e-3, atol=1e-3)
