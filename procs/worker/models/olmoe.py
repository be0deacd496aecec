"""`OlmoeForCausalLM`: the Llama decoder with q and k RMS-normed over their whole projections (not per head,
so a tensor-parallel rank's share of the squares is summed over the ranks), q, k and v clipped to
[-clip_qkv, clip_qkv] after the norms where the config sets it, and a mixture of experts of
`intermediate_size` in every layer."""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.base import config_path, with_defaults
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.procs.worker.models.moe import MoEConfig, num_experts
from batchserve.shared.model import ModelLoadError, ModelSpec

# transformers' OlmoeConfig defaults for the keys read here
CONFIG_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 8,
    "intermediate_size": 2048,
    "norm_topk_prob": False,
    "attention_bias": False,
    "clip_qkv": None,
    "rms_norm_eps": 1e-5,
}


class OlmoeModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, CONFIG_DEFAULTS)
        if raw.get("head_dim") not in (None, int(raw["hidden_size"]) // int(raw["num_attention_heads"])):
            raise ModelLoadError(
                f"head_dim {raw['head_dim']} in {config_path(spec)}: OLMoE's k norm spans "
                f"hidden_size / num_attention_heads per KV head"
            )
        clip = raw["clip_qkv"]
        if clip is not None and float(clip) <= 0:
            raise ModelLoadError(f"clip_qkv {clip} in {config_path(spec)} must be > 0")
        moe = MoEConfig.from_hf(
            raw,
            config_path(spec),
            num_layers=int(raw["num_hidden_layers"]),
            num_experts=num_experts(raw, 64),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=bool(raw["norm_topk_prob"]),
        )
        bias = bool(raw["attention_bias"])
        return LlamaConfig.from_hf(
            raw,
            spec,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="projection",
            clip_qkv=None if clip is None else float(clip),
            moe=moe,
        )
