"""A Gated DeltaNet layer (linear attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next), the token mixer of a hybrid
model's linear layers, on packed rows with each request's state in the pool (`kernels.recurrent_state`).

From the layer's input h: q | k | v (through a short causal convolution and SiLU), the output gate z, beta
= sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias), all from one fused projection;
then the gated delta rule (`kernels.gated_delta` in torch, or flash-linear-attention's Triton kernels when
`kernels.triton` is on: `kernels.triton.gated_delta`, the step's chunks packed into one call), a gated RMSNorm
per value head, and out_proj.
Checkpoints name the projections `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (Qwen3.5) or
`in_proj_qkvz` / `in_proj_ba`, grouped by key head (Qwen3-Next), which `split_grouped_projections`
turns into the first layout at load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from batchserve.kernels import native
from batchserve.kernels import triton as triton_kernels
from batchserve.kernels.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    gated_delta_step,
    gated_rms_norm,
)
from batchserve.kernels.recurrent_state import RecurrentShape, RecurrentStatePool
from batchserve.kernels.triton.gated_delta import chunk_rule, recurrent_step
from batchserve.procs.worker.models.base import Weight
from batchserve.procs.worker.models.layers import ColumnParallelLinear
from batchserve.procs.worker.models.weights import WeightTaker
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError


@dataclass(frozen=True)
class DeltaNetConfig:
    key_heads: int
    value_heads: int  # a multiple of key_heads: each key head serves value_heads // key_heads of them
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str) -> DeltaNetConfig:
        config = cls(
            key_heads=int(raw["linear_num_key_heads"]),
            value_heads=int(raw["linear_num_value_heads"]),
            key_dim=int(raw["linear_key_head_dim"]),
            value_dim=int(raw["linear_value_head_dim"]),
            conv_kernel=int(raw["linear_conv_kernel_dim"]),
        )
        if config.value_heads % config.key_heads or config.conv_kernel < 2:
            raise ModelLoadError(
                f"linear attention in {where}: linear_num_value_heads {config.value_heads} must be "
                f"a multiple of linear_num_key_heads {config.key_heads}, and linear_conv_kernel_dim "
                f"{config.conv_kernel} at least 2"
            )
        return config

    def of_heads(self, key_heads: int) -> DeltaNetConfig:
        """The layer's share of `key_heads` key heads and their value heads (a tensor-parallel rank's)."""
        return replace(self, key_heads=key_heads, value_heads=key_heads * (self.value_heads // self.key_heads))

    @property
    def key_size(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_size(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def state(self) -> RecurrentShape:
        return RecurrentShape(
            conv_dim=2 * self.key_size + self.value_size,
            conv_kernel=self.conv_kernel,
            heads=self.value_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
        )


class GatedDeltaNet:
    """One linear layer: its weights, and its index `layer` among the model's linear layers (its states')."""

    def __init__(
        self, take: WeightTaker, prefix: str, config: DeltaNetConfig, layer: int, eps: float, tp: TensorParallel
    ):
        key = tp.split(config.key_heads, "linear_num_key_heads")  # this rank's key heads and their value heads
        per = config.value_heads // config.key_heads
        self.config = cfg = config.of_heads(key.stop - key.start)
        self.layer, self.eps = layer, eps

        def rows(start: int, heads: slice, dim: int) -> slice:
            return slice(start + heads.start * dim, start + heads.stop * dim)

        value = slice(key.start * per, key.stop * per)
        conv_rows = [
            rows(0, key, cfg.key_dim),
            rows(config.key_size, key, cfg.key_dim),
            rows(2 * config.key_size, value, cfg.value_dim),
        ]  # q, k, v of this rank's heads
        take.expect(prefix + "conv1d.weight", (config.state.conv_dim, 1, config.conv_kernel))
        qkv = take.parts(prefix + "in_proj_qkv.weight", [(r,) for r in conv_rows])
        others = [
            take(prefix + name, rows=r)
            for name, r in (
                ("in_proj_z.weight", rows(0, value, cfg.value_dim)),
                ("in_proj_b.weight", value),
                ("in_proj_a.weight", value),
            )
        ]
        self.in_proj = ColumnParallelLinear(qkv + others, None, take.quantization)
        self.conv = torch.cat(take.parts(prefix + "conv1d.weight", [(r,) for r in conv_rows]))[:, 0].contiguous()
        self.neg_a = -take(prefix + "A_log", rows=value, dtype=torch.float32).exp()
        self.dt_bias = take(prefix + "dt_bias", rows=value)
        self.norm = take(prefix + "norm.weight")
        self.out = take.row(prefix + "out_proj", rows(0, value, cfg.value_dim), False, tp)
        self.splits = [cfg.state.conv_dim, cfg.value_size, cfg.value_heads, cfg.value_heads]

    def __call__(self, h: torch.Tensor, states: RecurrentStatePool) -> torch.Tensor:
        cfg, tokens = self.config, h.shape[0]
        qkv, z, b, a = self.in_proj(h).split(self.splits, dim=1)
        beta, g = b.sigmoid(), self.neg_a * F.softplus(a.float() + self.dt_bias)
        out = torch.empty((tokens, cfg.value_heads, cfg.value_dim), dtype=torch.float32, device=h.device)
        if states.decode_slots.numel():
            rows = states.decode_rows
            pick = (lambda x: x) if rows is None else (lambda x: x[rows])
            attended = self._decode(pick(qkv), pick(g), pick(beta), states)
            if rows is None:
                out = attended
            else:
                out[rows] = attended
        if states.chunks and triton_kernels.enabled():
            self._packed_chunks(qkv, g, beta, states, out)
        else:
            conv, matrix = states.conv[self.layer], states.matrix[self.layer]
            for chunk in states.chunks:
                span = slice(chunk.start, chunk.start + chunk.length)
                mixed, conv[chunk.slot] = causal_conv1d(qkv[span], self.conv, conv[chunk.slot])
                out[span], matrix[chunk.slot] = chunk_gated_delta_rule(
                    *self._qkv(mixed), g[span], beta[span], matrix[chunk.slot]
                )
        normed = gated_rms_norm(out.to(h.dtype), z.view(tokens, cfg.value_heads, cfg.value_dim), self.norm, self.eps)
        return self.out(normed.reshape(tokens, cfg.value_size))

    def _decode(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: RecurrentStatePool
    ) -> torch.Tensor:
        """The one-token rows (qkv, g, beta of those rows alone), their states read and written in the pool."""
        conv, matrix, slots = states.conv[self.layer], states.matrix[self.layer], states.decode_slots
        native_kernels = native.applies_to(qkv, conv, matrix)  # in place on the pools, one pass each: the same sums
        if native_kernels:
            mixed = native.causal_conv1d_decode(qkv, self.conv, conv, slots)
        else:
            mixed, conv_state = causal_conv1d_step(qkv, self.conv, conv[slots])
            conv.index_copy_(0, slots, conv_state.to(conv.dtype))
        if triton_kernels.enabled():
            attended, matrix_state = recurrent_step(*self._qkv(mixed), g, beta, matrix[slots])
        elif native_kernels:
            return native.gated_delta_decode(
                mixed, g.contiguous(), beta.contiguous(), matrix, slots, self.config.key_heads
            )
        else:
            attended, matrix_state = gated_delta_step(*self._qkv(mixed), g, beta, matrix[slots])
        matrix.index_copy_(0, slots, matrix_state)
        return attended

    def _packed_chunks(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: RecurrentStatePool, out: torch.Tensor
    ) -> None:
        """The step's longer rows (`states.chunks`) into `out`: each through the convolution, then all of them
        through the chunked delta rule in one Triton call, each from and back to its slot's state."""
        conv, matrix = states.conv[self.layer], states.matrix[self.layer]
        spans = [slice(chunk.start, chunk.start + chunk.length) for chunk in states.chunks]
        mixed = []
        for chunk, span in zip(states.chunks, spans):
            one, conv[chunk.slot] = causal_conv1d(qkv[span], self.conv, conv[chunk.slot])
            mixed.append(one)
        packing = states.packed
        assert packing is not None
        attended, final = chunk_rule(
            *self._qkv(torch.cat(mixed)),
            torch.cat([g[span] for span in spans]),
            torch.cat([beta[span] for span in spans]),
            matrix[packing.slots],
            packing.cu_seqlens,
            packing.cu_seqlens_cpu,
        )
        matrix.index_copy_(0, packing.slots, final)
        for span, start in zip(spans, packing.cu_seqlens_cpu.tolist()):
            out[span] = attended[start : start + span.stop - span.start]

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        q, k, v = mixed.split([cfg.key_size, cfg.key_size, cfg.value_size], dim=1)
        rows = mixed.shape[0]
        return (
            q.view(rows, cfg.key_heads, cfg.key_dim),
            k.view(rows, cfg.key_heads, cfg.key_dim),
            v.view(rows, cfg.value_heads, cfg.value_dim),
        )


def split_grouped_projections(weights: dict[str, Weight], config: DeltaNetConfig) -> None:
    """Qwen3-Next's `in_proj_qkvz` ([q k v z] per key head) and `in_proj_ba` ([b a] per key head) as
    Qwen3.5's `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b` and `in_proj_a`."""
    groups, per = config.key_heads, config.value_heads // config.key_heads
    dk, dv = config.key_dim, config.value_dim
    for name in [n for n in weights if n.endswith("linear_attn.in_proj_qkvz.weight")]:
        prefix = name[: -len("in_proj_qkvz.weight")]
        qkvz = _materialize(weights.pop(name))
        ba = _materialize(weights.pop(prefix + "in_proj_ba.weight"))
        hidden = qkvz.shape[-1]
        if qkvz.shape[0] != groups * (2 * dk + 2 * per * dv) or ba.shape[0] != groups * 2 * per:
            raise ModelLoadError(
                f"checkpoint tensors {prefix}in_proj_qkvz / in_proj_ba have {qkvz.shape[0]} / "
                f"{ba.shape[0]} rows, expected {groups * (2 * dk + 2 * per * dv)} / {groups * 2 * per}"
            )
        q, k, v, z = qkvz.view(groups, -1, hidden).split([dk, dk, per * dv, per * dv], dim=1)
        b, a = ba.view(groups, -1, hidden).split([per, per], dim=1)

        def flat(x: torch.Tensor, hidden: int = hidden) -> torch.Tensor:
            return x.reshape(-1, hidden)

        weights[prefix + "in_proj_qkv.weight"] = torch.cat((flat(q), flat(k), flat(v)))
        weights[prefix + "in_proj_z.weight"], weights[prefix + "in_proj_b.weight"] = flat(z), flat(b)
        weights[prefix + "in_proj_a.weight"] = flat(a)


def _materialize(weight: Weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]
