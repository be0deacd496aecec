"""Every decoder layer of a decode-only CPU step in one C call (`kernels/csrc/decode_layers.c`).

The C function runs the kernels the model's Python loop calls (panel linear layers, rotary, KV write,
paged decode attention, add-and-RMSNorm, SiLU-and-mul) in the same order on the same buffers, so the
tokens are bit-identical; it removes the Python and ctypes around a dozen calls per layer, a large
share of a small step. The layers' weight and KV-pool
addresses are gathered once into C structs; a step passes only its activations and its pages.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import native
from kernels.panel_linear import PanelWeight

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Projection(ctypes.Structure):
    _fields_ = [("packed", _ptr), ("scale", _ptr), ("bias", _ptr)]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection),
                ("post_norm", _ptr), ("next_norm", _ptr), ("k_pool", _ptr), ("v_pool", _ptr)]


class _DecodeShape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("page_size", _i64), ("max_pages", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class LayerTensors:
    """What one layer's fused call reads (the model's `LayerWeights` without q/k norms, and its pools)."""

    qkv: PanelWeight
    qkv_bias: torch.Tensor | None
    o: PanelWeight
    o_bias: torch.Tensor | None
    gate_up: PanelWeight
    gate_up_bias: torch.Tensor | None
    down: PanelWeight
    down_bias: torch.Tensor | None
    post_norm: torch.Tensor
    next_norm: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor


def _fp32_vector(t: torch.Tensor | None, size: int, name: str) -> int | None:
    if t is None:
        return None
    if t.shape != (size,) or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous fp32 CPU vector of {size}")
    return t.data_ptr()


def _projection(weight: PanelWeight, bias: torch.Tensor | None, in_features: int, out_features: int,
                name: str) -> _Projection:
    if weight.packed.shape[1] != in_features or weight.out_features != out_features:
        raise ValueError(f"{name}: panels for [{weight.out_features}, {weight.packed.shape[1]}], "
                         f"expected [{out_features}, {in_features}]")
    scale = weight.scale.data_ptr() if weight.scale is not None else None
    return _Projection(weight.packed.data_ptr(), scale, _fp32_vector(bias, out_features, f"{name} bias"))


class DecodeLayers:
    """The fused call for one model on one KV pool. Keeps the tensors it points into alive."""

    def __init__(self, layers: list[LayerTensors], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, page_size: int, eps: float, scale: float) -> None:
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        self._tensors = layers
        self._layers = (_DecodeLayer * len(layers))()
        for i, t in enumerate(layers):
            pool_shape = (page_size, kv_heads, head_dim)
            for pool in (t.k_pool, t.v_pool):
                if (pool.dim() != 4 or tuple(pool.shape[1:]) != pool_shape or pool.dtype != torch.float32
                        or not pool.is_contiguous() or not pool.is_cpu):
                    raise ValueError(f"layer {i}: KV pools must be contiguous fp32 [pages, {page_size}, "
                                     f"{kv_heads}, {head_dim}]")
            self._layers[i] = _DecodeLayer(
                _projection(t.qkv, t.qkv_bias, hidden, q_size + 2 * kv_size, f"layer {i} qkv"),
                _projection(t.o, t.o_bias, q_size, hidden, f"layer {i} o"),
                _projection(t.gate_up, t.gate_up_bias, hidden, 2 * intermediate, f"layer {i} gate_up"),
                _projection(t.down, t.down_bias, intermediate, hidden, f"layer {i} down"),
                _fp32_vector(t.post_norm, hidden, "post_norm"), _fp32_vector(t.next_norm, hidden, "next_norm"),
                t.k_pool.data_ptr(), t.v_pool.data_ptr())
        self._shape = _DecodeShape(hidden, heads, kv_heads, head_dim, intermediate, page_size, 0, eps, scale)
        self._widths = (q_size + 2 * kv_size, q_size + kv_size, q_size, hidden, 2 * intermediate, intermediate)
        self._head_dim = head_dim

    def run(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            locs: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Every layer on decode rows: h [rows, hidden] (the first layer's normed input, overwritten) and
        residual [rows, hidden] (the embeddings, used as scratch); cos/sin [rows, head_dim]; locs [rows] KV
        slots, pages [rows, max_pages] and lens [rows] as the cpu attention backend planned them: their
        values were checked there (`native.check_locs`, `native.check_pages`), only their layout is here.
        Returns h holding the final norm of every row."""
        rows, hidden = h.shape
        for name, t, shape in (("h", h, (rows, hidden)), ("residual", residual, (rows, hidden)),
                               ("cos", cos, (rows, self._head_dim)), ("sin", sin, (rows, self._head_dim))):
            if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"{name} must be contiguous fp32 {shape}")
        if not (locs.shape == lens.shape == (rows,) and pages.dim() == 2 and pages.shape[0] == rows
                and all(t.dtype == torch.int64 and t.is_contiguous() and t.is_cpu for t in (locs, pages, lens))):
            raise ValueError("locs [rows], pages [rows, max_pages] and lens [rows] must be contiguous int64")
        self._shape.max_pages = pages.shape[1]
        qkv, rot, attn, tmp, gate_up, act = (torch.empty((rows, width), dtype=torch.float32) for width in self._widths)
        status = native.library().decode_layers(
            ctypes.addressof(self._layers), len(self._tensors), ctypes.addressof(self._shape), rows, h.data_ptr(),
            residual.data_ptr(), cos.data_ptr(), sin.data_ptr(), locs.data_ptr(), pages.data_ptr(), lens.data_ptr(),
            qkv.data_ptr(), rot.data_ptr(), attn.data_ptr(), tmp.data_ptr(), gate_up.data_ptr(), act.data_ptr())
        if status != 0:
            raise MemoryError("decode_layers: attention could not allocate its scratch memory")
        return h
