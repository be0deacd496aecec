"""`MistralForCausalLM`: the Llama decoder without biases, whose every layer may attend to a sliding
window of the last `sliding_window` positions only (`base.sliding_windows`). As in transformers'
MistralConfig, null means no window and a config without the key has its default."""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.base import sliding_windows
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.shared.model import ModelSpec

DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default


class MistralModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        return LlamaConfig.from_hf(
            raw, spec, windows=sliding_windows(raw, spec, every_layer=True, default=DEFAULT_SLIDING_WINDOW)
        )
