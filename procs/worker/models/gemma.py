"""`Gemma2ForCausalLM` and `Gemma3ForCausalLM` (Gemma 3 1B, and text-only checkpoints): the Llama decoder
with Gemma's switches (`LlamaConfig`): GeGLU MLPs (tanh GELU), RMSNorm weights of 1 + w, a norm on each
sublayer's output before the residual add (post_attention / pre_ / post_feedforward_layernorm), embeddings
scaled by sqrt(hidden_size), scores scaled by `query_pre_attn_scalar` ** -0.5, sliding-window layers
beside global ones (`layer_types`; without it, transformers' default pattern), tied embeddings.
Gemma 2 soft-caps attention scores and the final logits; Gemma 3 norms q and k per head, gives its
sliding layers their own rope base (`rope_local_base_freq`, or transformers 5's per-layer-type
`rope_parameters`) and caps nothing unless its config says so.

`Gemma3ForConditionalGeneration` (Gemma 3 4B and larger) is served as its text model: its config is
`text_config` (`shared.model.read_model_json`), its language model's tensors (`language_model.model.*`,
or transformers 5's `model.language_model.*`) are the decoder's, and the vision tower's and the
multimodal projector's are skipped unread; the api refuses image inputs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from batchserve.procs.worker.models.base import FULL, SLIDING, Weight, config_path, with_defaults
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec
from batchserve.shared.rope import RopeConfig

# transformers' Gemma2Config / Gemma3TextConfig defaults for the keys read here
GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma(raw: dict[str, Any], spec: ModelSpec, default_layer_types: list[str], **switches: Any) -> LlamaConfig:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ModelLoadError(f"unsupported hidden_activation {act!r} in {config_path(spec)} (Gemma: gelu_pytorch_tanh)")
    if raw.get("layer_types") is None:
        raw = {**raw, "layer_types": default_layer_types}
    return LlamaConfig.from_hf(
        raw,
        spec,
        hidden_act="gelu_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=True,
        attn_scale=float(raw["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=float(raw["attn_logit_softcapping"] or 0),
        final_softcap=float(raw["final_logit_softcapping"] or 0),
        **switches,
    )


class Gemma2Model(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, GEMMA2_DEFAULTS)
        layers = int(raw["num_hidden_layers"])
        return _gemma(raw, spec, [SLIDING if (i + 1) % 2 else FULL for i in range(layers)])


class Gemma3Model(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, GEMMA3_DEFAULTS)
        layers, pattern = int(raw["num_hidden_layers"]), int(raw["sliding_window_pattern"])
        layer_types = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        where = config_path(spec)
        try:
            if isinstance((raw.get("rope_parameters") or {}).get(SLIDING), dict):  # transformers 5
                local = RopeConfig.from_hf(raw, where, SLIDING)
            else:
                local = RopeConfig(theta=float(raw.get("rope_local_base_freq") or 10000.0))
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        # the sliding layers' rope by their kind: a window spanning the served context masks nothing but
        # leaves the layer's rope its own
        return _gemma(
            raw,
            spec,
            layer_types,
            qk_norm="head",
            local_rope=local,
            local_rope_layers=tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING),
        )


# checkpoint prefixes of Gemma3ForConditionalGeneration: the language model's, renamed to the decoder's,
# and the towers a text model does not run
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3TextOfMultimodal(Gemma3Model):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError(f"use_bidirectional_attention in {config_path(spec)}: a causal decoder is served")
        return super().config_from_hf(raw, spec)

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
        return super().from_tensors(
            config,
            _language_model(tensors),
            max_positions=max_positions,
            dtype=dtype,
            device=device,
            quantization=quantization,
            tp=tp,
        )


def _language_model(tensors: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
    for name, tensor in tensors:
        if name.startswith(SKIPPED_PREFIXES):
            continue
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        yield (name if prefix is None else LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix) :]), tensor
