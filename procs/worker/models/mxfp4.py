"""MXFP4 weights (OCP Microscaling FP4, as gpt-oss ships its experts), de-quantized at load.

A checkpoint quantized with `quant_method: mxfp4` stores a weight `W` [..., rows, cols] as two tensors:
`W_blocks` [..., rows, cols / 32, 16] uint8, each byte two FP4 (E2M1) values, the low nibble first, and
`W_scales` [..., rows, cols / 32] uint8, one power-of-two scale per block of 32 values, biased by 127
(E8M0). A value is `FP4_VALUES[nibble] * 2 ** (scale - 127)`, what transformers' `convert_moe_packed_tensors`
computes before it transposes the result into GptOssExperts' [in, out] layout; this module keeps the
checkpoint's [out, in] rows, the layout our experts take. The result is exact in fp32 (and in bf16 for
the scales a checkpoint has), so the served model computes with what the quantized weights say.
"""

from __future__ import annotations

import torch

from batchserve.shared.model import ModelLoadError

# E2M1 values of the 16 nibbles: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127
QUANT_METHOD = "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, name: str = "") -> torch.Tensor:
    """fp32 [..., rows, G * 32] from `blocks` [..., rows, G, 16] uint8 and `scales` [..., rows, G] uint8."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(
            f"MXFP4 tensor {name}: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(
            f"MXFP4 tensor {name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
            f"must be [..., G, {BLOCK // 2}] and [..., G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, next byte
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None]).flatten(-2)
