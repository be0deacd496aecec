"""Every decoder layer of a CPU step in one C call (`kernels/csrc/decode_layers.c`): decode rows and prefill chunks.

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

from batchserve.kernels import native
from batchserve.kernels.moe import NativeMoeBlock
from batchserve.kernels.panel_linear import PanelWeight
from batchserve.kernels.projection import ProjectedWeight, ProjectionStruct, projection

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _LoraPair(ctypes.Structure):
    _fields_ = [("a", ProjectionStruct), ("b", ProjectionStruct), ("width", _i64)]


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        *((name, ProjectionStruct) for name in PROJECTIONS),
        *((f"lora_{name}", _LoraPair) for name in PROJECTIONS),
        ("moe", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("post_norm", _ptr),
        ("next_norm", _ptr),
        ("k_pool", _ptr),
        ("v_pool", _ptr),
        ("window", _i64),
    ]


class _DecodeShape(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("page_size", _i64),
        ("max_pages", _i64),
        ("whole_qk_norm", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("clip_qkv", _f32),
        ("lora_mask", _ptr),
        ("lora_total", _i64),
        ("lora_h", _ptr),
        ("lora_out", _ptr),
        ("chunks", _ptr),
        ("num_chunks", _i64),
    ]


@dataclass(frozen=True)
class LoraPair:
    """A projection's LoRA pairs as `procs.worker.lora.slots.LoraTarget` stacks them: every adapter's A [width, in] and
    B [out, width] as fp32 panels, width = its parts x the adapters' summed ranks."""

    a: PanelWeight
    b: PanelWeight

    @property
    def width(self) -> int:
        return self.a.out_features


def _lora_pair(pair: LoraPair | None, in_features: int, out_features: int, name: str) -> _LoraPair:
    if pair is None:
        return _LoraPair(projection(None), projection(None), 0)
    if pair.a.scale is not None or pair.b.scale is not None:
        raise ValueError(f"{name}: LoRA pairs must be fp32 panels")
    _projection(pair.a, None, in_features, pair.width, f"{name} LoRA A")
    _projection(pair.b, None, pair.width, out_features, f"{name} LoRA B")
    return _LoraPair(projection(pair.a), projection(pair.b), pair.width)


@dataclass(frozen=True)
class LayerTensors:
    """What one layer's fused call reads (the model's `LayerWeights`, and its pools): a dense MLP's
    projections, or (`moe`) a mixture of experts in the C kernel; q/k norm weights or None."""

    qkv: ProjectedWeight
    qkv_bias: torch.Tensor | None
    o: ProjectedWeight
    o_bias: torch.Tensor | None
    gate_up: ProjectedWeight | None
    gate_up_bias: torch.Tensor | None
    down: ProjectedWeight | None
    down_bias: torch.Tensor | None
    moe: NativeMoeBlock | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    next_norm: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    window: int = 0  # a sliding-window layer's window (attends to its last `window` tokens); 0: all
    lora: tuple[LoraPair | None, ...] = (None,) * len(PROJECTIONS)  # qkv, o, gate_up, down's LoRA pairs


def _fp32_vector(t: torch.Tensor | None, size: int, name: str) -> int | None:
    if t is None:
        return None
    if t.shape != (size,) or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous fp32 CPU vector of {size}")
    return t.data_ptr()


def _projection(
    weight: ProjectedWeight | None, bias: torch.Tensor | None, in_features: int, out_features: int, name: str
) -> ProjectionStruct:
    if weight is not None:
        weight_in = weight.packed.shape[1] if isinstance(weight, PanelWeight) else weight.in_features
        if weight_in != in_features or weight.out_features != out_features:
            raise ValueError(
                f"{name}: weights for [{weight.out_features}, {weight_in}], expected [{out_features}, {in_features}]"
            )
    _fp32_vector(bias, out_features, f"{name} bias")
    return projection(weight, bias)


def _moe_block(t: LayerTensors, hidden: int, i: int) -> int | None:
    if t.moe is None:
        if t.gate_up is None or t.down is None:
            raise ValueError(f"layer {i}: neither a dense MLP nor an MoE block")
        return None
    if t.moe.hidden != hidden:
        raise ValueError(f"layer {i}: MoE block for hidden size {t.moe.hidden}, expected {hidden}")
    return ctypes.addressof(t.moe.struct)


def _check_pools(t: LayerTensors, i: int, page_size: int, kv_heads: int, head_dim: int) -> None:
    """Layer `i`'s KV pools as the C code reads them: contiguous fp32 [pages, page_size, kv_heads, head_dim]."""
    pool_shape = (page_size, kv_heads, head_dim)
    for pool in (t.k_pool, t.v_pool):
        if (
            pool.dim() != 4
            or tuple(pool.shape[1:]) != pool_shape
            or pool.dtype != torch.float32
            or not pool.is_contiguous()
            or not pool.is_cpu
        ):
            raise ValueError(
                f"layer {i}: KV pools must be contiguous fp32 [pages, {page_size}, {kv_heads}, {head_dim}]"
            )


def _layer_struct(
    t: LayerTensors, i: int, sizes: tuple[tuple[int, int], ...], norm_sizes: tuple[int, int], hidden: int
) -> _DecodeLayer:
    """Layer `i`'s addresses for the C call, each checked against its shape: `sizes` are the projections'
    (in, out) in `PROJECTIONS` order, `norm_sizes` the q and k norms' lengths."""
    return _DecodeLayer(
        _projection(t.qkv, t.qkv_bias, *sizes[0], f"layer {i} qkv"),
        _projection(t.o, t.o_bias, *sizes[1], f"layer {i} o"),
        _projection(t.gate_up, t.gate_up_bias, *sizes[2], f"layer {i} gate_up"),
        _projection(t.down, t.down_bias, *sizes[3], f"layer {i} down"),
        *(_lora_pair(pair, *size, f"layer {i} {name}") for pair, size, name in zip(t.lora, sizes, PROJECTIONS)),
        _moe_block(t, hidden, i),
        _fp32_vector(t.q_norm, norm_sizes[0], "q_norm"),
        _fp32_vector(t.k_norm, norm_sizes[1], "k_norm"),
        _fp32_vector(t.post_norm, hidden, "post_norm"),
        _fp32_vector(t.next_norm, hidden, "next_norm"),
        t.k_pool.data_ptr(),
        t.v_pool.data_ptr(),
        t.window,
    )


def _check_step(
    h: torch.Tensor,
    residual: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    locs: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    chunks: torch.Tensor | None,
    head_dim: int,
) -> None:
    """The layout `DecodeLayers.run` passes to C: its activations' shapes and dtypes, and its pages'."""
    rows, hidden = h.shape
    for name, t, shape in (
        ("h", h, (rows, hidden)),
        ("residual", residual, (rows, hidden)),
        ("cos", cos, (rows, head_dim)),
        ("sin", sin, (rows, head_dim)),
    ):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(f"{name} must be contiguous fp32 {shape}")
    if not (
        locs.shape == lens.shape == (rows,)
        and pages.dim() == 2
        and pages.shape[0] == rows
        and all(t.dtype == torch.int64 and t.is_contiguous() and t.is_cpu for t in (locs, pages, lens))
    ):
        raise ValueError("locs [rows], pages [rows, max_pages] and lens [rows] must be contiguous int64")
    if chunks is not None and not (
        chunks.dim() == 2
        and chunks.shape[1] == 2
        and chunks.dtype == torch.int64
        and chunks.is_contiguous()
        and chunks.is_cpu
    ):
        raise ValueError("chunks must be contiguous int64 [chunks, 2]")


class DecodeLayers:
    """The fused call for one model on one KV pool. Keeps the tensors it points into alive."""

    def __init__(
        self,
        layers: list[LayerTensors],
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        page_size: int,
        eps: float,
        scale: float,
        whole_qk_norm: bool = False,
        clip_qkv: float = 0.0,
    ) -> None:
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        norm_sizes = (q_size, kv_size) if whole_qk_norm else (head_dim, head_dim)
        sizes = (  # each projection's (in, out), in `PROJECTIONS` order
            (hidden, q_size + 2 * kv_size),
            (q_size, hidden),
            (hidden, 2 * intermediate),
            (intermediate, hidden),
        )
        self._tensors = layers
        self._layers = (_DecodeLayer * len(layers))()
        for i, t in enumerate(layers):
            _check_pools(t, i, page_size, kv_heads, head_dim)
            self._layers[i] = _layer_struct(t, i, sizes, norm_sizes, hidden)
        self._shape = _DecodeShape(
            hidden, heads, kv_heads, head_dim, intermediate, page_size, 0, int(whole_qk_norm), eps, scale, clip_qkv
        )
        self._widths = (
            q_size + 2 * kv_size,
            q_size + kv_size,
            q_size + kv_size,
            q_size,
            hidden,
            2 * intermediate,
            intermediate,
        )
        self._head_dim = head_dim
        self._lora: tuple[torch.Tensor, ...] | None = None
        self._chunks: torch.Tensor | None = None
        pairs = [pair for t in layers for pair in t.lora if pair is not None]
        self._lora_widths = (max((p.width for p in pairs), default=0), max(self._widths[0], hidden, 2 * intermediate))

    def run(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        locs: torch.Tensor,
        pages: torch.Tensor,
        lens: torch.Tensor,
        chunks: torch.Tensor | None = None,
        lora_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every layer on the step's rows: h [rows, hidden] (the first layer's normed input, overwritten) and
        residual [rows, hidden] (the embeddings, used as scratch); cos/sin [rows, head_dim]; locs [rows] KV
        slots, pages [rows, max_pages], lens [rows] and the prefill chunks [C, 2] as the cpu attention backend
        planned them (`PagedRows`): their values were checked there (`native.check_locs`, `native.check_pages`),
        only their layout is here.
        `lora_mask` [rows, summed ranks]: the step's rows' adapter columns (`LoraSlots.mask`; None: no LoRA row).
        Returns h holding the final norm of every row."""
        _check_step(h, residual, cos, sin, locs, pages, lens, chunks, self._head_dim)
        rows = h.shape[0]
        self._shape.max_pages = pages.shape[1]
        self._set_chunks(chunks)
        scratch = [torch.empty((rows, width), dtype=torch.float32) for width in self._widths]
        self._set_lora(rows, lora_mask)
        status = native.loaded_library().decode_layers(
            ctypes.addressof(self._layers),
            len(self._tensors),
            ctypes.addressof(self._shape),
            rows,
            h.data_ptr(),
            residual.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            locs.data_ptr(),
            pages.data_ptr(),
            lens.data_ptr(),
            *(t.data_ptr() for t in scratch),
        )
        if status != 0:
            raise MemoryError("decode_layers: attention or an MoE block could not allocate its scratch memory")
        return h

    def _set_chunks(self, chunks: torch.Tensor | None) -> None:
        """The step's prefill chunks in the shape struct (kept alive on self until the next step: it points
        into them)."""
        self._chunks = chunks
        self._shape.chunks = None if chunks is None else chunks.data_ptr()
        self._shape.num_chunks = 0 if chunks is None else chunks.shape[0]

    def _set_lora(self, rows: int, mask: torch.Tensor | None) -> None:
        """The step's LoRA mask and scratch in the shape struct (kept alive on self until the next step)."""
        if mask is None or not self._lora_widths[0]:
            self._lora = None
            self._shape.lora_mask = None
            return
        if mask.shape[0] != rows or mask.dtype != torch.float32 or not mask.is_contiguous() or not mask.is_cpu:
            raise ValueError(f"lora_mask must be contiguous fp32 [{rows}, summed ranks]")
        self._lora = (mask, *(torch.empty((rows, width), dtype=torch.float32) for width in self._lora_widths))
        self._shape.lora_mask, self._shape.lora_total = mask.data_ptr(), mask.shape[1]
        self._shape.lora_h, self._shape.lora_out = (t.data_ptr() for t in self._lora[1:])
