"""`Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini): the Llama decoder from checkpoints that fuse q|k|v into
`qkv_proj` and gate|up into `gate_up_proj` (split at load into the Llama names, each part read on its
own), with rope that may be longrope and rotate only part of each head (`partial_rotary_factor`, Phi-4-mini's
0.75); both are the rope's (`shared.rope`, `kernels.rope`). Every layer slides when `sliding_window` is
set (Phi-3-mini-4k's 2047)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from batchserve.procs.worker.models.base import Weight, sliding_windows
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.procs.worker.models.weights import split_fused
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelSpec


class Phi3Model(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        return LlamaConfig.from_hf(raw, spec, windows=sliding_windows(raw, spec, every_layer=True))

    @classmethod
    def from_tensors(
        cls,
        config: LlamaConfig,
        tensors: Iterable[tuple[str, Weight]],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str = "none",
        tp: TensorParallel | None = None,
    ) -> LlamaModel:
        weights = dict(tensors)
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        split_fused(
            weights,
            "self_attn.qkv_proj.weight",
            [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv), ("self_attn.v_proj.weight", kv)],
        )
        mlp = config.intermediate_size
        split_fused(weights, "mlp.gate_up_proj.weight", [("mlp.gate_proj.weight", mlp), ("mlp.up_proj.weight", mlp)])
        return cls(
            config, weights, max_positions=max_positions, dtype=dtype, device=device, quantization=quantization, tp=tp
        )
