"""The model's ops: RMSNorm (alone or after the residual add), rotary embedding and SiLU-and-mul, and
the linear layers on pre-packed weights.

Each small op has a plain-torch form (`*_torch`), written to match transformers' Llama arithmetic in
fp32 so greedy outputs are token-identical, and runs the C kernel of `kernels.native` instead where
that applies (fp32 on the CPU): one pass over memory instead of a chain of small torch ops, each
reading and writing the whole activation. The C rotary embedding is bit-identical to the torch form; the C RMSNorm
sums its squares and the C SiLU exponentiates in their own way, a few ulp apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from batchserve.kernels import native
from batchserve.kernels.block_quantize import BLOCK_QUANTIZATIONS, quantize_weight
from batchserve.kernels.panel_linear import PanelWeight, pack_panels
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight, fuse_blocks
from batchserve.shared.config import QUANTIZATIONS

# what `pack_linear_weight` returns and `linear` takes: GGUF blocks (`kernels.quant_blocks`) stay as they came
LinearWeight = torch.Tensor | PanelWeight | BlockWeight | BlockParts


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    if x.dim() == 2 and native.applies_to(x, weight) and native.rows_contiguous(x) and weight.is_contiguous():
        return native.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's step: x += residual in place, then (RMSNorm(x), x)."""
    if (
        x.dim() == 2
        and native.applies_to(x, residual, weight)
        and x.is_contiguous()
        and residual.is_contiguous()
        and weight.is_contiguous()
    ):
        return native.add_rms_norm(x, residual, weight, eps)
    x.add_(residual)
    return rms_norm_torch(x, weight, eps), x


def rms_norm_groups(x: torch.Tensor, weight: torch.Tensor, eps: float, groups: int) -> torch.Tensor:
    """RMSNorm of each of the `groups` equal runs of x [tokens, groups * dim]'s rows by weight [dim]: q/k
    norms per head (groups = heads) or over a whole projection (groups = 1); a new contiguous tensor."""
    if native.applies_to(x, weight) and native.rows_contiguous(x) and weight.is_contiguous():
        return native.rms_norm_groups(x, groups, weight, eps)
    return rms_norm_torch(x.reshape(x.shape[0], groups, -1), weight, eps).reshape(x.shape[0], -1)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 like transformers' LlamaRMSNorm."""
    if x.dtype == torch.float32 and x.device.type == "cpu":  # torch's op: on CPU bit-identical to the formula below
        return torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token cos/sin [tokens, head_dim] (rotate-half layout)."""
    if native.applies_to(x, cos, sin) and native.rows_contiguous(x) and cos.is_contiguous() and sin.is_contiguous():
        return native.rotary(x, cos, sin)
    return apply_rotary_torch(x, cos, sin)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed-weight linear ops (x86 CPU builds do)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linear_weight(
    weight: torch.Tensor | BlockWeight, quantization: str = "none", *, head: bool = False
) -> LinearWeight:
    """The form `linear` runs fastest from. On the CPU at fp32: the C kernel's panels
    (`kernels.panel_linear`; fp32, or int8 with `quantization="int8"`, which needs them), or GGUF blocks (a
    GGUF file's as they are; `q8_0`, `q4_0`, `q4_k` quantize into them: `kernels.block_quantize`, `head`: the
    LM head's type). Without the C kernels, oneDNN's pre-reordered layout (1.5-2x MKL's sgemm behind `F.linear`
    for decode batches on this CPU). Elsewhere (CUDA, bf16) the plain weight is already the best form."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}")
    if quantization in BLOCK_QUANTIZATIONS:
        dense = weight.dequantize() if isinstance(weight, BlockWeight) else weight
        return quantize_weight(dense, quantization, head=head)
    if isinstance(weight, BlockWeight):
        return weight
    on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if quantization == "int8" or (on_cpu_fp32 and native.available()):  # auto and none: panels of the fp32
        return pack_panels(weight, quantization)
    if on_cpu_fp32 and onednn_linear_available():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return weight


def pack_linear_parts(parts: Sequence[torch.Tensor | BlockWeight], quantization: str = "none") -> LinearWeight:
    """Projections fused along the output features, packed: in their blocks where every part came in blocks
    (`WeightTaker.linear_weight` keeps them only where they run), else de-quantized and packed as one tensor."""
    if quantization in BLOCK_QUANTIZATIONS:  # each part quantized on its own: a fused weight of one type or parts
        return fuse_blocks([cast(BlockWeight, pack_linear_weight(p, quantization)) for p in parts])
    blocks = [p for p in parts if isinstance(p, BlockWeight)]
    if blocks and len(blocks) == len(parts):
        return fuse_blocks(blocks)
    tensors = [p.dequantize() if isinstance(p, BlockWeight) else p for p in parts]
    return pack_linear_weight(torch.cat(tensors, dim=0), quantization)


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), for a weight from `pack_linear_weight`."""
    if isinstance(weight, PanelWeight | BlockWeight | BlockParts):
        return weight(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for a fused [tokens, 2 * intermediate] projection output."""
    if gate_up.dim() == 2 and native.applies_to(gate_up) and native.rows_contiguous(gate_up):
        return native.silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :half]).mul_(gate_up[..., half:])


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) (tanh approximation, transformers' `gelu_pytorch_tanh`) * up: Gemma's GeGLU."""
    half = gate_up.shape[-1] // 2
    return torch.nn.functional.gelu(gate_up[..., :half], approximate="tanh").mul_(gate_up[..., half:])


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}  # act(gate) * up, by name
