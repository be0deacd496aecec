"""`Qwen3ForCausalLM`: the Llama decoder with q and k RMS-normed per head before rotary; attention_bias
biases q, k, v and o, the MLP has none."""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.shared.model import ModelSpec


class Qwen3Model(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        bias = bool(raw.get("attention_bias", False))
        return LlamaConfig.from_hf(raw, spec, qkv_bias=bias, o_bias=bias, qk_norm="head")
