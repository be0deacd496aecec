"""Linear-layer weights for the CPU's C kernel (`kernels/csrc/panel_linear.c`): packed once at load in
panels of output columns, fp32 as the checkpoint has them or rounded to int8 (`--quantization int8`).

int8: each output channel is rounded symmetrically (scale = max |w| / 127); the kernel widens the
weights to fp32 as it reads them and computes in fp32, so a decode step reads a quarter of the bytes
for a small loss of accuracy (measured: `loadtests/results/int8_accuracy_cpu.txt` (now `quant_accuracy.py`)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchserve.kernels import native


@dataclass(frozen=True)
class PanelWeight:
    """A linear layer's [out, in] weight as panels [panels, in, native.PANEL] (fp32, or int8 with `scale`)."""

    packed: torch.Tensor
    scale: torch.Tensor | None  # int8: [panels * PANEL] fp32 per output channel (0 for the padding)
    out_features: int

    def __post_init__(self) -> None:
        native.check_panels(self.packed, self.scale, self.out_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return native.panel_linear(x, self.packed, self.scale, bias, self.out_features, panels_checked=True)


def pack_panels(weight: torch.Tensor, quantization: str = "none") -> PanelWeight:
    """Pack an fp32 CPU weight [out, in] into panels; `quantization="int8"` rounds it per output channel first."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(f"panel weights are packed from fp32 CPU weights, got {weight.dtype} on {weight.device}")
    out_features, in_features = weight.shape
    width = native.PANEL
    panels = -(-out_features // width)
    scale = None
    if quantization == "int8":
        scale = torch.zeros(panels * width, dtype=torch.float32)
        scale[:out_features] = weight.abs().amax(dim=1) / 127.0
        divisor = torch.where(scale[:out_features] > 0, scale[:out_features], 1.0)[:, None]
        weight = torch.round(weight / divisor).clamp_(-127, 127).to(torch.int8)
    padded = torch.zeros((panels * width, in_features), dtype=weight.dtype)
    padded[:out_features] = weight
    packed = padded.reshape(panels, width, in_features).permute(0, 2, 1).contiguous()
    return PanelWeight(packed, scale, out_features)


@dataclass(frozen=True)
class StackedPanels:
    """One projection per expert [experts, out, in], each packed as `PanelWeight` packs it, stacked:
    packed [experts, panels, in, native.PANEL] (fp32, or int8 with `scale` [experts, panels * PANEL])."""

    packed: torch.Tensor
    scale: torch.Tensor | None
    out_features: int

    def expert(self, e: int) -> PanelWeight:
        return PanelWeight(self.packed[e], None if self.scale is None else self.scale[e], self.out_features)


def pack_stacked_panels(weights: torch.Tensor, quantization: str = "none") -> StackedPanels:
    """Pack fp32 CPU weights [experts, out, in] expert by expert (int8: rounded per output channel)."""
    experts = [pack_panels(w, quantization) for w in weights]
    scale = None
    if quantization == "int8":  # every expert's panels have a scale
        scales = [e.scale for e in experts if e.scale is not None]
        assert len(scales) == len(experts)
        scale = torch.stack(scales)
    return StackedPanels(torch.stack([e.packed for e in experts]), scale, weights.shape[1])
