"""The weights a GGUF file keeps in quantized blocks, read from the file where it lies (`shared.gguf_convert`
lists them in the converted folder's manifest): each a `BlockTensor`, a view of the `mmap`ed file.

A linear layer takes its share as a `kernels.quant_blocks.BlockWeight` (no copy for a whole tensor, so
the worker's resident memory is about the file's size); everything else that reads one (a layer on
CUDA, `--quantization int8`, an architecture's own processing) indexes it like a safetensors slice and
gets fp32 values, de-quantized by the C kernels.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from batchserve.kernels import native
from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockType, BlockWeight, dequantize_blocks
from batchserve.shared.errors import ModelLoadError
from batchserve.shared.gguf_convert import MANIFEST


class BlockTensor:
    """A 2-D GGUF tensor [rows, columns] in its blocks: data uint8 [rows, row_bytes]. A sibling that builds its
    blocks from other tensors (`procs.worker.hf_quantized_tensors`) overrides `data`, `get_shape`, `row_blocks`
    and `rows_fp32`, and builds only the rows a rank takes."""

    def __init__(self, data: torch.Tensor, kind: BlockType):
        self._data = data
        self.kind = kind

    @property
    def data(self) -> torch.Tensor:
        return self._data

    def get_shape(self) -> list[int]:
        return [self.data.shape[0], self.data.shape[1] // self.kind.block_bytes * self.kind.block]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.get_shape())

    def splits_at(self, cols: slice | None) -> bool:
        """Whether `cols` (None: all) start and stop on block boundaries."""
        start, stop, _ = (cols or slice(None)).indices(self.get_shape()[1])
        return start % self.kind.block == 0 and stop % self.kind.block == 0

    def blocks(self, rows: slice | None = None, cols: slice | None = None) -> BlockWeight:
        """`rows` (all of its columns) or `cols` (of every row; on block boundaries) as a linear layer's weight."""
        weight = self.row_blocks(rows)
        if cols is not None:
            start, stop, _ = cols.indices(self.get_shape()[1])
            weight = weight.take_columns(start, stop)
        return weight

    def row_blocks(self, rows: slice | None) -> BlockWeight:
        """`rows` (None: all) of every column as a weight."""
        weight = BlockWeight(self.data, self.kind)
        return weight if rows is None else weight.take_rows(rows)

    def rows_fp32(self, rows: Any) -> torch.Tensor:
        """fp32 values of `rows` (an index of the first dimension), every column."""
        return _dequantize(self.data[rows].contiguous(), self.kind)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """fp32 values of `index` (rows, or (rows, columns)), as a safetensors slice reads them."""
        rows, *rest = index if isinstance(index, tuple) else (index,)
        values = self.rows_fp32(rows)
        return values[(slice(None), *rest)] if rest else values


def _dequantize(data: torch.Tensor, kind: BlockType) -> torch.Tensor:
    """The C kernels' de-quantization, or gguf-py's (the same values, slower) where they are not built."""
    if native.available():
        return dequantize_blocks(data, kind)
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(dequantize(data.numpy(), GGMLQuantizationType(kind.id)))


def _undo_rope_interleave(data: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q / k rows back in Hugging Face's order (transformers' `_reverse_permute_weights`)."""
    rows, width = data.shape
    return data.reshape(heads, rows // heads // 2, 2, width).transpose(1, 2).reshape(rows, width).contiguous()


def has_block_tensors(model_dir: Path) -> bool:
    return (model_dir / MANIFEST).is_file()


def iter_block_tensors(model_dir: Path) -> Iterator[tuple[str, BlockTensor]]:
    """(Hugging Face name, BlockTensor) for every tensor the folder's manifest keeps in the GGUF file."""
    import numpy as np

    manifest = json.loads((model_dir / MANIFEST).read_text())
    paths = [Path(file) for file in manifest["files"]]
    for path in paths:
        if not path.is_file():
            raise ModelLoadError(
                f"{model_dir} reads its weights from {path}, which is gone: delete {model_dir} to redo it"
            )
    # copy-on-write: torch wants a writable array, and the pages stay the file's (nothing writes them)
    files = [np.memmap(path, dtype=np.uint8, mode="c") for path in paths]
    for hf_name, entry in manifest["tensors"].items():
        (rows, row_bytes), start = entry["shape"], entry["offset"]
        file = files[entry["file"]]
        data = torch.from_numpy(file[start : start + rows * row_bytes].reshape(rows, row_bytes))
        if entry["heads"]:
            data = _undo_rope_interleave(data, entry["heads"])
        yield hf_name, BlockTensor(data, BLOCK_TYPES[entry["type"]])
