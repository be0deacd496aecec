"""Weights kept in GGUF blocks of 32 multiplied on the Triton path (W4A16 for Q4_0 / Q4_1, W8A16 for Q8_0):
GGUF legacy files, and AWQ / GPTQ / FP8 folders repacked into those blocks at load, stay packed on the GPU
instead of being de-quantized to 16-bit. The k-quants (blocks of 256) are de-quantized at load there."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchserve.kernels.triton import LAUNCHES

if TYPE_CHECKING:
    from batchserve.kernels.quant_blocks import BlockWeight

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the block types the kernel reads (`blocks_kernel.KIND`)
BLOCK_N = 64


def _block_m(rows: int) -> int:
    """Rows a program takes: 16 for decode batches (tl.dot's least), 64 for prefill chunks."""
    return 16 if rows <= 16 else 64


def block_matmul(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] (fp32, fp16 or bf16; rows may be strided) times the block weight, plus bias: [m, out] in x's type."""
    from batchserve.kernels.triton.blocks_kernel import block_matmul_kernel

    rows, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.out_features
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = _block_m(rows)
    grid = (-(-rows // block_m), -(-n // BLOCK_N))
    block_matmul_kernel[grid](
        x,
        weight.data,
        out,
        rows,
        n,
        k,
        x.stride(0),
        out.stride(0),
        weight.data.stride(0),
        KIND=KINDS[weight.kind.name],
        BLOCK_BYTES=weight.kind.block_bytes,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=64 if k >= 64 else 32,
    )
    LAUNCHES["blocks"] += 1
    return out if bias is None else out.add_(bias)
