"""`Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM`: Qwen2's and Qwen3's decoders with a mixture of experts
in the layers `decoder_sparse_step` and `mlp_only_layers` pick (the others keep a dense MLP of
`intermediate_size`), experts of `moe_intermediate_size`, the top k renormalised only where
`norm_topk_prob` says so. Qwen2-MoE adds a shared expert to every token, scaled by sigmoid(x . gate)."""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.base import config_path, sliding_windows, with_defaults
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.procs.worker.models.moe import MoEConfig, num_experts
from batchserve.shared.model import ModelLoadError, ModelSpec

# transformers' Qwen2MoeConfig and Qwen3MoeConfig defaults for the keys read here
QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "intermediate_size": 5632,
    "qkv_bias": True,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-6,
}
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "intermediate_size": 6144,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "rms_norm_eps": 1e-6,
}


def qwen_moe_config(raw: dict[str, Any], spec: ModelSpec, experts: int, shared: int = 0) -> MoEConfig:
    return MoEConfig.from_hf(
        raw,
        config_path(spec),
        num_layers=int(raw["num_hidden_layers"]),
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw["norm_topk_prob"]),
        shared_expert_intermediate_size=shared,
        decoder_sparse_step=int(raw["decoder_sparse_step"]),
        mlp_only_layers=tuple(raw["mlp_only_layers"] or ()),
    )


class Qwen2MoeModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, QWEN2_MOE_DEFAULTS)
        shared = int(raw["shared_expert_intermediate_size"])
        if shared <= 0:
            raise ModelLoadError(
                f"shared_expert_intermediate_size {shared} in {config_path(spec)}: Qwen2-MoE's "
                f"shared expert is in every sparse layer"
            )
        return LlamaConfig.from_hf(
            raw, spec, qkv_bias=bool(raw["qkv_bias"]), moe=qwen_moe_config(raw, spec, num_experts(raw, 60), shared)
        )


class Qwen3MoeModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, QWEN3_MOE_DEFAULTS)
        bias = bool(raw["attention_bias"])
        return LlamaConfig.from_hf(
            raw,
            spec,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="head",
            moe=qwen_moe_config(raw, spec, num_experts(raw, 128)),
            windows=sliding_windows(raw, spec, every_layer=True),
        )  # no layer_types here
