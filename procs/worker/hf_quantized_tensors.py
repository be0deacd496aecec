"""A Hugging Face quantized checkpoint's linear weight as a `BlockTensor` (`procs.worker.hf_quantized` finds
them): kept by `WeightTaker` in GGUF blocks for the C kernels, or read as fp32 by indexing, which
de-quantizes the checkpoint's own values exactly (no block rounding: CUDA, `--quantization int8`, experts).

- `Int4Weight`: AWQ (GEMM) or GPTQ, w[out, in] = (q - zero) * scale per group of input features. A group is
  whole 32-value blocks, so each block is GGUF's Q4_1 (value = d * q + m) with d = scale and m = -zero * scale,
  whose fp16 rounding of m is the only change (|error| <= |zero * scale| * 2^-11); a tensor whose zeros are all
  8 (symmetric GPTQ) is Q4_0 (value = d * (q - 8)), exactly.
- `Fp8Weight`: float8 values times an fp32 scale per block / output channel / tensor, re-quantized to Q8_0 by
  gguf-py a few rows at a time (|error| <= half a Q8_0 step plus its fp16 scale's rounding).

Only the output rows a tensor-parallel rank takes are unpacked and repacked (`row_blocks`, `rows_fp32`).
"""

from __future__ import annotations

from typing import Any

import torch

from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockType, BlockWeight
from batchserve.procs.worker.gguf_tensors import BlockTensor
from batchserve.shared.errors import ModelLoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i of a word holds output column 8 k + AWQ_ORDER[i]
PLAIN_ORDER = tuple(range(8))  # GPTQ's: nibble i holds value 8 k + i (low bits first)
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
BLOCK = 32  # values per GGUF block (Q4_0, Q4_1, Q8_0)
CHUNK = 1 << 22  # values repacked at a time (16 MB as fp32)


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [n, k] of 8 nibbles each -> uint8 [n, 8 k], nibble i of word j at column 8 j + order[i]."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> SHIFTS) & 15  # [n, k, nibble]
    where = sorted(range(8), key=lambda i: order[i])  # for each column of the 8, its nibble
    return nibbles[..., where].reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [k, n] of 8 nibbles each -> uint8 [8 k, n], nibble i of word j at row 8 j + i."""
    nibbles = (packed.to(torch.int32).unsqueeze(1) >> SHIFTS.view(1, 8, 1)) & 15  # [k, nibble, n]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def shape_of(tensor: Any, name: str) -> tuple[int, int]:
    """The shape of a 2-D checkpoint tensor (a tensor or a safetensors slice); ModelLoadError for another."""
    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())
    if len(shape) != 2:
        raise ModelLoadError(
            f"checkpoint tensor {name}: quantized with shape {list(shape)}, served only as 2-D weights"
        )
    return int(shape[0]), int(shape[1])


def _span(rows: Any, count: int) -> tuple[int, int] | None:
    """(start, stop) of a step-1 slice of `count` rows; None for any other index."""
    if rows is None:
        return 0, count
    if isinstance(rows, slice):
        start, stop, step = rows.indices(count)
        if step == 1:
            return start, max(start, stop)
    return None


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 [r, n] -> its little-endian bytes [r, n, 2] (a block's header field)."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)


class RepackedTensor(BlockTensor):
    """A weight [out, in] whose blocks are built from a checkpoint's tensors, a few rows at a time (no `_data`:
    `data` is built when asked for)."""

    def __init__(self, name: str, shape: tuple[int, int], kind: BlockType):
        if shape[1] % BLOCK:
            raise ModelLoadError(f"checkpoint tensor {name}: {shape[1]} input features, not whole {BLOCK}-value blocks")
        self.name, self._shape, self.kind = name, shape, kind

    @property
    def data(self) -> torch.Tensor:
        return self.span_blocks(0, self._shape[0])

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def row_blocks(self, rows: slice | None) -> BlockWeight:
        span = _span(rows, self._shape[0])
        if span is None:
            return BlockWeight(self.data, self.kind).take_rows(rows)  # type: ignore[arg-type]
        return BlockWeight(self.span_blocks(*span), self.kind)

    def rows_fp32(self, rows: Any) -> torch.Tensor:
        span = _span(rows, self._shape[0])
        return self.span_fp32(*span) if span else self.span_fp32(0, self._shape[0])[rows]

    def span_blocks(self, start: int, stop: int) -> torch.Tensor:
        """uint8 blocks [stop - start, row_bytes] of rows start:stop, built `CHUNK` values at a time."""
        fan_in = self._shape[1]
        out = torch.empty((stop - start, fan_in // BLOCK * self.kind.block_bytes), dtype=torch.uint8)
        step = max(8, CHUNK // fan_in // 8 * 8)  # whole words of AWQ's packed rows
        for first in range(start, stop, step):
            last = min(stop, first + step)
            out[first - start : last - start] = self.chunk_blocks(first, last)
        return out

    def chunk_blocks(self, start: int, stop: int) -> torch.Tensor:
        """`span_blocks` of a few rows."""
        raise NotImplementedError

    def span_fp32(self, start: int, stop: int) -> torch.Tensor:
        """The checkpoint's de-quantized values [stop - start, in] of rows start:stop (its reference rule)."""
        raise NotImplementedError


class Int4Weight(RepackedTensor):
    """An AWQ or GPTQ weight: qweight int32 (AWQ: [in, out / 8], `AWQ_ORDER`; GPTQ: [in / 8, out], along the
    input), zeros uint8 [groups, out] (unpacked, offset added), scales fp16 [groups, out]."""

    def __init__(
        self, name: str, qweight: Any, zeros: torch.Tensor, scales: torch.Tensor, *, along_input: bool
    ) -> None:
        groups, out = shape_of(scales, name)
        rows, words = shape_of(qweight, name)
        fan_in = rows * 8 if along_input else rows
        if zeros.shape != (groups, out) or (words if along_input else words * 8) != out or fan_in % groups:
            raise ModelLoadError(
                f"checkpoint tensor {name}: qweight {[rows, words]}, qzeros {list(zeros.shape)} and scales "
                f"{list(scales.shape)} do not describe one [{out}, in] weight in groups of input features"
            )
        self.group = fan_in // groups
        if self.group % BLOCK:
            raise ModelLoadError(f"checkpoint tensor {name}: groups of {self.group} inputs, not whole 32-value blocks")
        symmetric = bool((zeros == 8).all())  # Q4_0's implicit zero
        super().__init__(name, (out, fan_in), BLOCK_TYPES["Q4_0" if symmetric else "Q4_1"])
        self.qweight, self.zeros, self.scales, self.along_input = qweight, zeros, scales, along_input

    def _unpacked(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [r, in], zero uint8 [r, groups], scale fp16 [r, groups]) of rows start:stop."""
        if self.along_input:
            q = unpack_rows(self.qweight[:, start:stop])
        else:
            first = start // 8
            q = unpack_columns(self.qweight[:, first : -(-stop // 8)], AWQ_ORDER)[:, start - 8 * first :]
            q = q[:, : stop - start]
        return q.t(), self.zeros[:, start:stop].t(), self.scales[:, start:stop].t()

    def span_fp32(self, start: int, stop: int) -> torch.Tensor:
        q, zero, scale = self._unpacked(start, stop)
        grouped = q.reshape(stop - start, -1, self.group).float()
        return ((grouped - zero.unsqueeze(-1).float()) * scale.unsqueeze(-1).float()).reshape(stop - start, -1)

    def chunk_blocks(self, start: int, stop: int) -> torch.Tensor:
        q, zero, scale = self._unpacked(start, stop)
        rows, per_group = stop - start, self.group // BLOCK
        d = scale.repeat_interleave(per_group, dim=1)  # [r, blocks]
        halves = q.reshape(rows, -1, 2, BLOCK // 2)  # byte j: value j (low nibble), value j + 16 (high)
        header = [_half_bytes(d)]
        if self.kind.name == "Q4_1":  # m = -zero * scale: exact in fp32, rounded once to fp16
            m = -zero.repeat_interleave(per_group, dim=1).float() * d.float()
            header.append(_half_bytes(m))
        nibbles = halves[:, :, 0] | (halves[:, :, 1] << 4)
        return torch.cat((*header, nibbles), dim=2).reshape(rows, -1)


class Fp8Weight(RepackedTensor):
    """A float8 weight [out, in] times an fp32 scale [ceil(out / rows), ceil(in / cols)] for each block of
    `rows` x `cols` values (a tensor's scale: one block; an output channel's: blocks of one row)."""

    def __init__(self, name: str, weight: Any, scale: torch.Tensor, block: tuple[int, int]) -> None:
        out, fan_in = shape_of(weight, name)
        rows, cols = block
        if tuple(scale.shape) != (-(-out // rows), -(-fan_in // cols)):
            raise ModelLoadError(
                f"checkpoint tensor {name}: scale of shape {list(scale.shape)}, expected one per "
                f"{rows} x {cols} block of its {[out, fan_in]}"
            )
        super().__init__(name, (out, fan_in), BLOCK_TYPES["Q8_0"])
        self.weight, self.scale, self.block = weight, scale.float(), block

    def span_fp32(self, start: int, stop: int) -> torch.Tensor:
        rows, cols = self.block
        row_scale = self.scale[torch.arange(start, stop) // rows]
        return self.weight[start:stop].float() * row_scale[:, torch.arange(self._shape[1]) // cols]

    def chunk_blocks(self, start: int, stop: int) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quantize

        return torch.from_numpy(quantize(self.span_fp32(start, stop).numpy(), GGMLQuantizationType.Q8_0))
