"""`MixtralForCausalLM`: Mistral's decoder with a mixture of experts in every layer. transformers'
MixtralTopKRouter takes the softmax over every expert, the top k, and divides them by their sum (the
softmax of the top k's logits, in other words); the experts are `block_sparse_moe.experts.{e}.w1` (gate),
`w3` (up) and `w2` (down), or transformers 5's fused tensors."""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.base import config_path, sliding_windows, with_defaults
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.procs.worker.models.moe import MIXTRAL_EXPERTS, MoEConfig, num_experts
from batchserve.shared.model import ModelSpec

# transformers' MixtralConfig defaults for the keys read here
CONFIG_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 2,
    "intermediate_size": 14336,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
}


class MixtralModel(LlamaModel):
    EXPERT_NAMES = MIXTRAL_EXPERTS

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, CONFIG_DEFAULTS)
        moe = MoEConfig.from_hf(
            raw,
            config_path(spec),
            num_layers=int(raw["num_hidden_layers"]),
            num_experts=num_experts(raw, 8),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
        return LlamaConfig.from_hf(raw, spec, moe=moe, windows=sliding_windows(raw, spec, every_layer=True))
