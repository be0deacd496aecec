"""Mixture-of-experts compute: a layer's experts stacked (`Experts`), the router's top-k (`route`), and the
experts' gated MLPs over tokens grouped by expert, each expert's rows as one matmul.

Two paths, as for the dense layers (`kernels.ops`):
- the C kernel (`kernels/csrc/moe.c`, fp32 or int8 panels on the CPU): router, top-k, experts, weighted sum
  and shared expert in one call (`NativeMoeBlock`), the same call the fused decode layers make;
- torch (CUDA, or a CPU without the C kernels): `route` then `experts_forward`, which sorts the (token,
  choice) pairs by expert and runs `torch._grouped_mm` over them: no host synchronisation, so CUDA graphs
  capture it (transformers' `grouped_mm` experts are the model for it).

Routing matches transformers': softmax over every expert in fp32, the top k, divided by their sum where
the model renormalises (`norm_topk_prob`; Mixtral always). A token's output adds its experts' weighted
outputs in top-k order. With expert parallelism a rank holds experts [first, first + count) and adds only
theirs; the ranks' outputs are summed after (`procs.worker.models.moe`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchserve.kernels import native
from batchserve.kernels.block_quantize import BLOCK_QUANTIZATIONS
from batchserve.kernels.ops import silu_and_mul_torch
from batchserve.kernels.panel_linear import PanelWeight, StackedPanels, pack_stacked_panels
from batchserve.kernels.projection import ProjectionStruct, projection


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation of gate | up [rows, 2 * I]: (up + 1) * gate * sigmoid(alpha * gate), the gate
    clamped above at `limit` and up to [-limit, limit] first (transformers' GptOssExperts arithmetic)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# A gated MLP's activation of its fused gate | up output [rows, 2 * I] -> [rows, I]: SiLU-and-mul by name
# (what the C kernel runs), or a `ClampedSwiGLU`.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": silu_and_mul_torch}
ExpertActivation = str | ClampedSwiGLU
ExpertWeight = torch.Tensor | StackedPanels


def activation_fn(activation: ExpertActivation) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[activation] if isinstance(activation, str) else activation


@dataclass(frozen=True)
class Experts:
    """This rank's experts of one layer: gate | up [count, 2 * I, hidden] and down [count, hidden, I], as
    plain tensors or C panels; optional biases [count, 2 * I] and [count, hidden]; global ids
    [first, first + count)."""

    gate_up: ExpertWeight
    down: ExpertWeight
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    first: int
    count: int
    intermediate: int  # this rank's share of each expert's intermediate size
    activation: ExpertActivation = "silu"

    @property
    def panels(self) -> bool:
        return isinstance(self.gate_up, StackedPanels)


def pack_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    *,
    first: int,
    quantization: str,
    activation: ExpertActivation = "silu",
) -> Experts:
    """Experts from stacked weights, packed as `kernels.ops.pack_linear_weight` packs a dense layer: C panels
    on the CPU at fp32 (int8 with `quantization="int8"`), plain tensors elsewhere. The C kernel runs SiLU
    experts only: others are plain tensors, and int8 is refused for them."""
    if isinstance(activation, str) and activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}")
    if quantization in BLOCK_QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization}: experts are not kept in blocks yet; use int8 or none")
    if quantization == "int8" and activation != "silu":
        raise ValueError(f"int8 experts run in the C kernel, whose experts are SiLU-gated, not {activation}")
    on_cpu_fp32 = gate_up.device.type == "cpu" and gate_up.dtype == torch.float32
    panels = quantization == "int8" or (on_cpu_fp32 and native.available() and activation == "silu")
    pack = (lambda w: pack_stacked_panels(w, quantization)) if panels else (lambda w: w.contiguous())
    return Experts(
        pack(gate_up),
        pack(down),
        gate_up_bias,
        down_bias,
        first=first,
        count=gate_up.shape[0],
        intermediate=gate_up.shape[1] // 2,
        activation=activation,
    )


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] fp32, expert ids [tokens, k] int64) from router logits [tokens, experts]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def count_load(load: torch.Tensor, ids: torch.Tensor) -> None:
    """Add the tokens routed to each expert to `load` [experts] (graph-safe: no host synchronisation)."""
    flat = ids.reshape(-1)
    load.index_add_(0, flat, torch.ones_like(flat))


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over this rank's experts, for x [tokens, hidden]."""
    tokens, top_k = ids.shape
    count = experts.count
    local = ids.reshape(-1) - experts.first
    mine = (local >= 0) & (local < count)
    local = torch.where(mine, local, count)  # another rank's expert: sorted last, run by none
    order = torch.argsort(local, stable=True)
    grouped = local[order]
    rows = x[order // top_k]
    if grouped_mm_runs(x.device, x.dtype):
        y = _grouped_experts(rows, grouped, experts)
    else:
        y = _expert_loop(rows, grouped, experts)
    # rows past the last expert's are not written by grouped_mm: masked, not multiplied (NaN * 0)
    y = torch.where(mine[order, None], y.float() * weights.reshape(-1)[order, None], 0.0)
    out = torch.empty_like(y).index_copy_(0, order, y)
    return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm takes fp32 on the CPU and bf16 on CUDA (torch 2.9 and newer); elsewhere the
    experts run one matmul each (`_expert_loop`, which CUDA graphs cannot capture)."""
    return hasattr(torch, "_grouped_mm") and (device.type == "cpu" or dtype == torch.bfloat16)


def _grouped_experts(rows: torch.Tensor, grouped: torch.Tensor, experts: Experts) -> torch.Tensor:
    count = experts.count
    ends = torch.zeros(count + 1, dtype=torch.int64, device=rows.device).index_add_(
        0, grouped, torch.ones_like(grouped)
    )
    offsets = ends[:count].cumsum(0).to(torch.int32)
    owner = grouped.clamp(max=count - 1)
    gate_up, down = _tensors(experts)
    h = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets)
    if experts.gate_up_bias is not None:
        h = h + experts.gate_up_bias[owner]
    y = torch._grouped_mm(activation_fn(experts.activation)(h), down.transpose(-2, -1), offs=offsets)
    return y if experts.down_bias is None else y + experts.down_bias[owner]


def _tensors(experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' gate | up and down as the torch path takes them: plain tensors (panels run in the C kernel)."""
    gate_up, down = experts.gate_up, experts.down
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    return gate_up, down


def _expert_bias(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert e's row of a stacked bias, or None for no bias."""
    return None if bias is None else bias[e]


def _expert_loop(rows: torch.Tensor, grouped: torch.Tensor, experts: Experts) -> torch.Tensor:
    """One matmul per expert with rows (a torch without `_grouped_mm`; not graph-safe: it reads the counts)."""
    y = rows.new_zeros(rows.shape)
    gate_up, down = _tensors(experts)
    start = 0
    for e, n in enumerate(torch.bincount(grouped, minlength=experts.count + 1)[: experts.count].tolist()):
        if n:
            h = torch.nn.functional.linear(rows[start : start + n], gate_up[e], _expert_bias(experts.gate_up_bias, e))
            y[start : start + n] = torch.nn.functional.linear(
                activation_fn(experts.activation)(h), down[e], _expert_bias(experts.down_bias, e)
            )
        start += n
    return y


# ---------------------------------------------------------------------------------------------
# The C kernel's block

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _StackedProjection(ctypes.Structure):
    _fields_ = [
        ("packed", _ptr),
        ("scale", _ptr),
        ("bias", _ptr),
        ("packed_stride", _i64),
        ("scale_stride", _i64),
        ("bias_stride", _i64),
    ]


class _MoeBlock(ctypes.Structure):
    _fields_ = [
        ("router", ProjectionStruct),
        ("gate_up", _StackedProjection),
        ("down", _StackedProjection),
        *((name, ProjectionStruct) for name in ("shared_gate_up", "shared_down", "shared_gate")),
        ("load", _ptr),
        *[
            (name, _i64)
            for name in (
                "num_experts",
                "first",
                "count",
                "top_k",
                "renormalize",
                "hidden",
                "intermediate",
                "shared_intermediate",
            )
        ],
    ]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _stacked(weight: StackedPanels, bias: torch.Tensor | None) -> _StackedProjection:
    packed = weight.packed
    return _StackedProjection(
        packed.data_ptr(),
        _ptr_of(weight.scale),
        _ptr_of(bias),
        packed.stride(0) * packed.element_size(),
        0 if weight.scale is None else weight.scale.stride(0),
        0 if bias is None else bias.stride(0),
    )


@dataclass(frozen=True)
class SharedExpert:
    """Qwen2-MoE's shared expert as panels: gate | up, down, and its sigmoid gate [1, hidden]."""

    gate_up: PanelWeight
    down: PanelWeight
    gate: PanelWeight


class NativeMoeBlock:
    """One MoE layer in the C kernel: `block(x)` is this rank's share of its output. Keeps the tensors it
    points into alive; `load` [num_experts] int64 gets the tokens routed to each expert added."""

    def __init__(
        self,
        router: PanelWeight,
        router_bias: torch.Tensor | None,
        experts: Experts,
        shared: SharedExpert | None,
        *,
        top_k: int,
        renormalize: bool,
        load: torch.Tensor,
    ) -> None:
        gate_up, down = experts.gate_up, experts.down
        if not (isinstance(gate_up, StackedPanels) and isinstance(down, StackedPanels)) or experts.activation != "silu":
            raise ValueError("the C MoE block runs SiLU experts packed as panels")
        hidden = router.packed.shape[1]
        self._keep = (router, router_bias, experts, shared, load)
        self.hidden = hidden
        shared_inter = 0 if shared is None else shared.down.packed.shape[1]
        self.struct = _MoeBlock(
            projection(router, router_bias),
            _stacked(gate_up, experts.gate_up_bias),
            _stacked(down, experts.down_bias),
            projection(None if shared is None else shared.gate_up),
            projection(None if shared is None else shared.down),
            projection(None if shared is None else shared.gate),
            load.data_ptr(),
            router.out_features,
            experts.first,
            experts.count,
            top_k,
            int(renormalize),
            hidden,
            experts.intermediate,
            shared_inter,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if not (
            x.dim() == 2
            and x.shape[1] == self.hidden
            and x.dtype == torch.float32
            and x.is_cpu
            and native.rows_contiguous(x)
        ):
            raise ValueError(f"x must be fp32 [rows, {self.hidden}] on the CPU, rows contiguous")
        out = torch.empty((rows, self.hidden), dtype=torch.float32)
        if not rows:
            return out
        lib = native.library()
        if lib is None:
            raise native.NativeKernelError("the C MoE block needs the C kernels, which are not available")
        if lib.moe_block(ctypes.addressof(self.struct), x.data_ptr(), rows, x.stride(0), out.data_ptr()) != 0:
            raise MemoryError("moe_block could not allocate its scratch memory")
        return out
