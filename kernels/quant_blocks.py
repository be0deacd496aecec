"""Linear-layer weights kept in GGUF's quantized blocks, bit for bit as the file has them (read through
`mmap`: resident memory about the file's size, no conversion at load), and their C kernels
(`kernels/csrc/quant_blocks.h`): a block type's de-quantization (equal to gguf-py's numpy `dequantize`)
and the linear layer. Below `TILE_MIN_ROWS` rows (decode) the activations are rounded per block to int16 and
dotted with the weight's integer blocks (ggml's scheme, with int16 where ggml has int8:
`kernels/csrc/quant_blocks.h` says why), each weight byte read once; from there on (a prefill chunk) the weight
is de-quantized a cache-sized tile at a time into fp32 panels for the fp32 panel kernel, bit for bit the
de-quantized model's product (`kernels/csrc/quant_linear.c`; `loadtests/results/gguf_blocks_cpu.txt` has the
speed).

A `BlockWeight` is one [out, in] weight: `out` rows, each `in / block` blocks of `block_bytes` bytes.
Rows may be taken (a tensor-parallel shard of the output features, llama.cpp's q/k row order undone)
and columns cut on block boundaries (a shard of the input features), without touching a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchserve.kernels.native_build import loaded_library
from batchserve.kernels.native_checks import check, check_rows
from batchserve.kernels.triton import enabled as triton_enabled
from batchserve.kernels.triton.blocks import block_matmul


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type: its name and id (ggml_type), values and bytes per block."""

    name: str
    id: int
    block: int
    block_bytes: int


BLOCK_TYPES = {
    t.name: t
    for t in (
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q5_0", 6, 32, 22),
        BlockType("Q5_1", 7, 32, 24),
        BlockType("MXFP4", 39, 32, 17),
        BlockType("Q4_K", 12, 256, 144),
        BlockType("Q5_K", 13, 256, 176),
        BlockType("Q6_K", 14, 256, 210),
    )
}
BLOCK_TYPE_IDS = {t.id: t for t in BLOCK_TYPES.values()}
TILE_MIN_ROWS = 48  # rows from which a call de-quantizes fp32 tiles (TILE_MIN_ROWS in csrc/quant_linear.c)


def _check_blocks(data: torch.Tensor, kind: BlockType) -> None:
    check(data.dtype == torch.uint8 and data.is_cpu and data.dim() >= 1, "blocks must be uint8 on the CPU")
    check(data.shape[-1] % kind.block_bytes == 0, f"a {kind.name} row is whole {kind.block_bytes}-byte blocks")
    check(data.is_contiguous(), "blocks must be contiguous")


def dequantize_blocks(data: torch.Tensor, kind: BlockType) -> torch.Tensor:
    """uint8 blocks [..., row_bytes] -> fp32 [..., row_bytes / block_bytes * block], as gguf-py computes them."""
    _check_blocks(data, kind)
    blocks = data.numel() // kind.block_bytes
    out = torch.empty((*data.shape[:-1], data.shape[-1] // kind.block_bytes * kind.block), dtype=torch.float32)
    if blocks:
        rc = loaded_library().block_dequantize(kind.id, data.data_ptr(), blocks, out.data_ptr())
        check(rc == 0, f"the C kernels have no {kind.name} blocks")
    return out


@dataclass(frozen=True)
class BlockWeight:
    """An [out_features, in_features] weight as out_features rows of GGUF blocks: data uint8 [out, row_bytes]."""

    data: torch.Tensor
    kind: BlockType

    def __post_init__(self) -> None:
        _check_blocks(self.data, self.kind)
        check(self.data.dim() == 2, "block weights are [out, row_bytes]")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // self.kind.block_bytes * self.kind.block

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def shape(self) -> torch.Size:
        """The weight's [out_features, in_features], as a tensor's."""
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return block_linear(x, self, bias)

    def dequantize(self) -> torch.Tensor:
        return dequantize_blocks(self.data, self.kind)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` (an embedding lookup on a quantized table), de-quantized on the CPU (the few rows of a
        step's tokens, where the table lies on a GPU), on the table's device."""
        picked = self.data[ids.reshape(-1)].cpu().contiguous()
        return dequantize_blocks(picked, self.kind).to(self.data.device).reshape(*ids.shape, -1)

    def take_rows(self, index: torch.Tensor | slice) -> BlockWeight:
        """The rows `index` selects (a copy where it is not a plain slice)."""
        return BlockWeight(self.data[index].contiguous(), self.kind)

    def take_columns(self, start: int, stop: int) -> BlockWeight:
        """Input features [start, stop), both on block boundaries (a copy)."""
        check(start % self.kind.block == 0 and stop % self.kind.block == 0, "columns cut on block boundaries")
        first, last = start // self.kind.block * self.kind.block_bytes, stop // self.kind.block * self.kind.block_bytes
        return BlockWeight(self.data[:, first:last].contiguous(), self.kind)


def block_linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] fp32 (rows may be strided) times `weight`, plus bias [out]: [m, out] fp32; on the Triton path
    (`kernels.triton`: the GPU) x in any float type, the result in x's."""
    if triton_enabled():
        return block_matmul(x, weight, bias)
    check(x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == weight.in_features, "x must be [m, in] fp32")
    check_rows(x, "x")
    if bias is not None:
        check(
            bias.shape == (weight.out_features,) and bias.dtype == torch.float32 and bias.is_contiguous(),
            "bias must be [out] fp32",
        )
    out = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
    rc = loaded_library().block_linear(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        weight.data.data_ptr(),
        weight.kind.id,
        None if bias is None else bias.data_ptr(),
        weight.out_features,
        weight.in_features,
        out.data_ptr(),
    )
    check(rc == 0, f"block_linear failed ({rc}) on {weight.kind.name}")
    return out


@dataclass(frozen=True, eq=False)  # compared by identity: the C structs of its parts are kept per weight
class BlockParts:
    """Block weights fused along the output (q, k and v; gate and up), each part where it lies: a GGUF file's
    parts stay views of the `mmap`ed file (joining them would copy them out of it: the worker would hold both,
    +0.35 GB of a 0.67 GB 1B Q4_K_M file), and parts may differ in type (a Q4_K_M file's v in Q6_K beside q
    and k in Q4_K). Each part's rows in turn."""

    parts: tuple[BlockWeight, ...]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([block_linear(x, p) for p in self.parts], dim=1)
        return out if bias is None else out.add_(bias)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def fuse_blocks(parts: list[BlockWeight]) -> BlockWeight | BlockParts:
    """Projections' block weights fused along the output, without a copy (`BlockParts`)."""
    check(len({p.in_features for p in parts}) == 1, "fused projections share their input features")
    return parts[0] if len(parts) == 1 else BlockParts(tuple(parts))
