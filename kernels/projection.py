"""A linear layer's weight as the fused C kernels read it (`kernels/csrc/projection.h`'s `Projection`): panels
(fp32, or int8 with a scale per output column) or GGUF blocks, and a bias. Block weights of several types
fused along the output (`BlockParts`) are a chain of structs, one per part, kept alive beside the weight."""

from __future__ import annotations

import ctypes
import weakref

import torch

from batchserve.kernels.panel_linear import PanelWeight
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64

ProjectedWeight = PanelWeight | BlockWeight | BlockParts  # what `projection` takes


class ProjectionStruct(ctypes.Structure):
    pass


ProjectionStruct._fields_ = [
    ("packed", _ptr),
    ("scale", _ptr),
    ("bias", _ptr),
    ("block_type", _i64),  # 0: panels
    ("next", ctypes.POINTER(ProjectionStruct)),  # the next part of a `BlockParts`
    ("rows", _i64),  # this part's output rows, where a next part follows
]

# each BlockParts' tail structs (its parts after the first), alive as long as the weight is
_TAILS: weakref.WeakKeyDictionary[BlockParts, list[ProjectionStruct]] = weakref.WeakKeyDictionary()


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def projection(weight: ProjectedWeight | None, bias: torch.Tensor | None = None) -> ProjectionStruct:
    """The C struct of a weight (None: an absent projection)."""
    if weight is None:
        return ProjectionStruct(None, None, None, 0, None, 0)
    if isinstance(weight, PanelWeight):
        return ProjectionStruct(weight.packed.data_ptr(), _ptr_of(weight.scale), _ptr_of(bias), 0, None, 0)
    if isinstance(weight, BlockWeight):
        return ProjectionStruct(weight.data.data_ptr(), None, _ptr_of(bias), weight.kind.id, None, 0)
    if weight not in _TAILS:
        tail: list[ProjectionStruct] = []
        for part in reversed(weight.parts[1:]):
            after = ctypes.pointer(tail[-1]) if tail else None
            tail.append(ProjectionStruct(part.data.data_ptr(), None, None, part.kind.id, after, part.out_features))
        _TAILS[weight] = tail
    first, tail = weight.parts[0], _TAILS[weight]
    return ProjectionStruct(
        first.data.data_ptr(), None, _ptr_of(bias), first.kind.id, ctypes.pointer(tail[-1]), first.out_features
    )
