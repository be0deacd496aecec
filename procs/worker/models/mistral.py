"""`MistralForCausalLM`: the Llama decoder without biases, whose attention may be limited to a sliding
window of the last `sliding_window` positions. Attention here spans the whole context, the same
arithmetic only while the window covers every request, so a narrower window is refused
(`refuse_narrow_window`, for every architecture with a window). As in transformers' MistralConfig, null
means no window and a config without the key has its default."""

from __future__ import annotations

from typing import Any

from procs.worker.models.base import config_path
from procs.worker.models.llama import LlamaConfig, LlamaModel
from shared.model import ModelLoadError, ModelSpec

DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default


def refuse_narrow_window(window: int | None, spec: ModelSpec) -> None:
    """ModelLoadError for a sliding window shorter than the served context (None: no window)."""
    if window is not None and int(window) < spec.context_length:
        raise ModelLoadError(f"sliding_window {window} in {config_path(spec)} is shorter than the context "
                             f"length {spec.context_length}, and sliding-window attention is not supported: "
                             f"serve it with --max-context {window} or less")


class MistralModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        refuse_narrow_window(raw.get("sliding_window", DEFAULT_SLIDING_WINDOW), spec)
        return LlamaConfig.from_hf(raw, spec)
