"""`WeightTaker`: how a model takes its tensors from a checkpoint. Each tensor is taken once (what is left
over at the end is an error the model raises), read only as far as this rank's share of it, converted to
the model's dtype and device, and checked for its shape, naming it when it is missing or misshapen. A linear
layer's weight kept in GGUF blocks (`procs.worker.gguf_tensors`) stays in them where the CPU kernels take it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchserve.kernels import native
from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockWeight
from batchserve.kernels.triton import enabled as triton_enabled
from batchserve.kernels.triton.blocks import KINDS as TRITON_KINDS
from batchserve.procs.worker.gguf_tensors import BlockTensor
from batchserve.procs.worker.models.base import Weight
from batchserve.procs.worker.models.layers import ColumnParallelLinear, RowParallelLinear
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError

Index = tuple[slice, ...]


class WeightTaker:
    """Pops named tensors from a checkpoint dict (name -> tensor or safetensors slice)."""

    def __init__(self, weights: dict[str, Weight], dtype: torch.dtype, device: torch.device, quantization: str):
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        # Blocks are kept where kernels run them and nothing asked for another form: the Triton kernels' types
        # (`kernels.triton.blocks`: the GPU, or the interpreter), else every type where the C kernels run (fp32 on
        # the CPU); the rest is de-quantized at load.
        c_kernels = device.type == "cpu" and dtype == torch.float32 and native.available()
        kinds = set(TRITON_KINDS) if triton_enabled() else set(BLOCK_TYPES) if c_kernels else set()
        self.block_kinds = kinds if quantization == "none" else set()

    def has(self, name: str) -> bool:
        return name in self.weights

    def shape(self, name: str) -> tuple[int, ...]:
        weight = self._get(name)
        return tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight.get_shape())

    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        """ModelLoadError naming `name` unless it is there with `shape`."""
        if self.shape(name) != shape:
            raise ModelLoadError(f"checkpoint tensor {name} has shape {self.shape(name)}, expected {shape}")

    def _get(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise ModelLoadError(f"checkpoint lacks tensor {name}") from None

    def skip(self, name: str) -> None:
        """Take `name` without reading it (another rank's part)."""
        self._get(name)
        del self.weights[name]

    def __call__(
        self,
        name: str,
        *,
        rows: slice | None = None,
        cols: slice | None = None,
        pad_rows: int = 0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Tensor `name` (its `rows`, or its `cols` of every row), zero rows appended up to `pad_rows`."""
        index = (rows,) if rows is not None else (slice(None), cols) if cols is not None else (slice(None),)
        tensor = self.parts(name, [index], dtype)[0]
        if tensor.shape[0] < pad_rows:
            padding = tensor.new_zeros((pad_rows - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat((tensor, padding))
        return tensor

    def parts(self, name: str, indices: Sequence[Index], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The `indices` of tensor `name`, each read on its own (in the model's dtype, or `dtype`)."""
        weight = self._get(name)
        del self.weights[name]
        return [weight[index].to(device=self.device, dtype=dtype or self.dtype).contiguous() for index in indices]

    def linear_weight(
        self, name: str, *, rows: slice | None = None, cols: slice | None = None, pad_rows: int = 0
    ) -> torch.Tensor | BlockWeight:
        """`self(name, ...)`, or the same share in its GGUF blocks where they are kept and a tensor-parallel
        rank's columns start and end on block boundaries (padding rows of zero bytes are zeros in every type)."""
        weight = self._get(name)
        if not (isinstance(weight, BlockTensor) and weight.kind.name in self.block_kinds and weight.splits_at(cols)):
            return self(name, rows=rows, cols=cols, pad_rows=pad_rows)
        del self.weights[name]
        blocks = weight.blocks(rows, cols)
        if blocks.out_features < pad_rows:
            padding = blocks.data.new_zeros((pad_rows - blocks.out_features, blocks.data.shape[1]))
            blocks = BlockWeight(torch.cat((blocks.data, padding)), blocks.kind)
        return blocks if self.device.type == "cpu" else BlockWeight(blocks.data.to(self.device), blocks.kind)

    def column(self, projections: Sequence[tuple[str, slice | None]], bias: bool) -> ColumnParallelLinear:
        """The named projections' output `rows` (None: all of them) (`<name>.weight`, and `<name>.bias`
        with `bias`), fused along the output."""
        biases = [self(name + ".bias", rows=rows) for name, rows in projections] if bias else None
        return ColumnParallelLinear(
            [self.linear_weight(name + ".weight", rows=rows) for name, rows in projections], biases, self.quantization
        )

    def row(
        self, projection: str, cols: slice | None, bias: bool, tp: TensorParallel, *, reduce: bool = True
    ) -> RowParallelLinear:
        """The projection's input `cols` (None: all of them), and its whole bias with `bias`; `reduce`:
        summed over the ranks."""
        return RowParallelLinear(
            self.linear_weight(projection + ".weight", cols=cols),
            self(projection + ".bias") if bias else None,
            self.quantization,
            tp,
            reduce=reduce,
        )


class FusedPart:
    """Rows `start:stop` of a checkpoint tensor that fuses several projections (Phi-3's qkv_proj and
    gate_up_proj), read as a tensor of its own: indexing reads only the part asked for."""

    def __init__(self, weight: Weight, start: int, stop: int):
        self.weight, self.start, self.stop = weight, start, stop

    def get_shape(self) -> list[int]:
        shape = list(self.weight.shape) if isinstance(self.weight, torch.Tensor) else list(self.weight.get_shape())
        return [self.stop - self.start, *shape[1:]]

    def __getitem__(self, index: Index) -> torch.Tensor:
        rows, *rest = index if isinstance(index, tuple) else (index,)
        first, last, step = rows.indices(self.stop - self.start)
        if step != 1:
            raise ValueError("a fused part reads contiguous rows")
        return self.weight[(slice(self.start + first, self.start + last), *rest)]


def split_fused(weights: dict[str, Weight], fused: str, parts: list[tuple[str, int]]) -> None:
    """Replace every tensor named `*<fused>` by its consecutive row blocks `*<part>` of `rows` rows each."""
    for name in [n for n in weights if n.endswith(fused)]:
        weight, prefix, start = weights.pop(name), name[: -len(fused)], 0
        shape = FusedPart(weight, 0, 0).get_shape()[1:]
        total = sum(rows for _, rows in parts)
        rows_there = weight.shape[0] if isinstance(weight, torch.Tensor) else weight.get_shape()[0]
        if rows_there != total:
            raise ModelLoadError(
                f"checkpoint tensor {name} has {rows_there} rows, expected {total} "
                f"({' + '.join(f'{part} {rows}' for part, rows in parts)}) of width {shape}"
            )
        for part, rows in parts:
            weights[prefix + part] = FusedPart(weight, start, start + rows)
            start += rows
