"""`Qwen2ForCausalLM`: the Llama decoder with a bias on q, k and v (none on o or the MLP)."""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.shared.model import ModelSpec


class Qwen2Model(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        return LlamaConfig.from_hf(raw, spec, qkv_bias=True)
