"""Hybrid linear-attention models: `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and
the text model of the released multimodal checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`, whose config.json holds the decoder's in `text_config`).

Most layers are Gated DeltaNet (`procs.worker.models.gated_deltanet`, a state per request instead of KV);
every `full_attention_interval`-th (or as `layer_types` says) is full attention on the Llama decoder with
an output gate (q_proj is twice as wide: per head, the query and then its gate), q and k normed per
head, partial rotary (a quarter of each head's dims unless the config says). Every RMSNorm but the linear
layers' output norm is (1 + w). Qwen3.5's multimodal rope (mrope) rotates text, whose three position
ids are equal, as the plain rope does. The MLPs are dense (Qwen3.5), or a mixture of experts with a gated
shared expert (Qwen3.5-MoE: every layer; Qwen3-Next: as `decoder_sparse_step` and `mlp_only_layers` say).

Skipped at load, as transformers skips them: the multi-token-prediction head (`mtp.*`, a later
speculation source) and the vision tower (`model.visual.*`); image inputs are refused by the api.
Tensor parallelism splits the linear layers by key heads (each with its value heads), as attention by heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from batchserve.procs.worker.lora.slots import LoraSlots, LoraTarget
from batchserve.procs.worker.models.base import Weight, config_path, with_defaults
from batchserve.procs.worker.models.gated_deltanet import DeltaNetConfig, GatedDeltaNet, split_grouped_projections
from batchserve.procs.worker.models.llama import LayerWeights, LlamaConfig, LlamaModel
from batchserve.procs.worker.models.moe import MoEConfig, num_experts
from batchserve.procs.worker.models.qwen_moe import qwen_moe_config
from batchserve.procs.worker.models.weights import WeightTaker
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec

LINEAR, FULL = "linear_attention", "full_attention"  # transformers' `layer_types` here
# transformers' config defaults (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig) for the keys read here
HYBRID_DEFAULTS: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "head_dim": 256,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}
QWEN3_NEXT_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
}
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "intermediate_size": 0,
}
SKIPPED_PREFIXES = ("mtp.", "model.visual.")
LANGUAGE_MODEL_PREFIX = "model.language_model."


@dataclass(frozen=True)
class HybridConfig(LlamaConfig):
    deltanet: DeltaNetConfig | None = None


def hybrid_config(raw: dict[str, Any], spec: ModelSpec, moe: MoEConfig | None) -> HybridConfig:
    """The decoder of config.json `raw` (its architecture's defaults applied) with mixture `moe`."""
    where, layers = config_path(spec), int(raw["num_hidden_layers"])
    interval = int(raw["full_attention_interval"])
    kinds = raw.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {LINEAR, FULL}:
        raise ModelLoadError(f"layer_types in {where}: {layers} of {LINEAR!r} or {FULL!r} expected")
    if raw["hidden_act"] != "silu":
        raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r} in {where}")
    params = raw.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in raw:
        raw = {**raw, "partial_rotary_factor": 0.25}  # transformers' default for these models
    deltanet = DeltaNetConfig.from_hf(raw, where)
    bias = bool(raw["attention_bias"])
    config = HybridConfig.from_hf(
        raw,
        spec,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        norm_offset=1.0,
        attn_output_gate=True,
        moe=moe,
        windows=(),
        deltanet=deltanet,
        linear_layers=tuple(i for i, kind in enumerate(kinds) if kind == LINEAR),
        recurrent=deltanet.state,
    )
    assert isinstance(config, HybridConfig)  # `from_hf` builds its class (LlamaConfig's is typed as its own)
    return config


class HybridModel(LlamaModel):
    """The decoder of these models; each architecture reads its config (`config_from_hf`)."""

    config: HybridConfig

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
        assert isinstance(config, HybridConfig) and config.deltanet is not None
        weights = dict(_text_model(tensors))
        split_grouped_projections(weights, config.deltanet)
        for name in [
            n for n in weights if n.endswith("self_attn.q_proj.weight") or n.endswith("self_attn.q_proj.bias")
        ]:
            _split_query_gate(weights, name, config.head_dim)
        return cls(
            config, weights, max_positions=max_positions, dtype=dtype, device=device, quantization=quantization, tp=tp
        )

    def enable_lora(self, slots: LoraSlots) -> LoraSlots:
        """As the decoder's, on the full layers' attention and every layer's MLP (the linear layers' own
        projections are not PEFT's seven); q_proj's pairs are split as its weights are, the gate's rows
        (`q_gate`) added by the output gate's projection."""
        slots = super().enable_lora(slots)
        head_dim = self.config.head_dim
        slots.split_outputs["q_proj"] = lambda b: dict(zip(("q_proj", "q_gate"), split_query_gate(b, head_dim)))
        slots.shards["q_gate"] = slots.shards["q_proj"]
        for index, layer in enumerate(self.layers):
            if layer.attn_gate is not None:
                layer.attn_gate.lora = LoraTarget(slots, index, [("q_gate", slice(None))])
        return slots

    def _layer(self, take: WeightTaker, i: int, sparse: bool) -> LayerWeights:
        cfg = self.config
        if i not in cfg.linear_layers:
            layer = super()._layer(take, i, sparse)
            q = slice(self.heads.q.start * cfg.head_dim, self.heads.q.stop * cfg.head_dim)
            layer.attn_gate = take.column([(f"model.layers.{i}.self_attn.q_gate", q)], cfg.qkv_bias)
            return layer
        assert cfg.deltanet is not None
        prefix = f"model.layers.{i}."
        mixer = GatedDeltaNet(
            take, prefix + "linear_attn.", cfg.deltanet, cfg.linear_layers.index(i), cfg.rms_norm_eps, self.tp
        )
        return LayerWeights(
            input_norm=self._norm(take, prefix + "input_layernorm.weight"),
            qkv=None,
            q_norm=None,
            k_norm=None,
            o=None,
            post_norm=self._norm(take, prefix + "post_attention_layernorm.weight"),
            mlp=self._mlp(take, prefix, sparse),
            mixer=mixer,
        )


class Qwen3NextModel(HybridModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, {**HYBRID_DEFAULTS, **QWEN3_NEXT_MOE_DEFAULTS})
        shared = int(raw["shared_expert_intermediate_size"])
        experts = num_experts(raw, 512)
        return hybrid_config(raw, spec, qwen_moe_config(raw, spec, experts, shared) if experts else None)


class Qwen3_5Model(HybridModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        return hybrid_config(with_defaults(raw, HYBRID_DEFAULTS), spec, None)


class Qwen3_5MoeModel(HybridModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = with_defaults(raw, {**HYBRID_DEFAULTS, **QWEN3_5_MOE_DEFAULTS})
        return hybrid_config(
            raw, spec, qwen_moe_config(raw, spec, num_experts(raw, 256), int(raw["shared_expert_intermediate_size"]))
        )


def _text_model(tensors: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
    """The decoder's tensors under the names of a text checkpoint: the multi-token-prediction head and the
    vision tower skipped, a multimodal checkpoint's language model renamed."""
    for name, tensor in tensors:
        if name.startswith(SKIPPED_PREFIXES):
            continue
        yield (
            ("model." + name[len(LANGUAGE_MODEL_PREFIX) :] if name.startswith(LANGUAGE_MODEL_PREFIX) else name),
            tensor,
        )


def _split_query_gate(weights: dict[str, Weight], name: str, head_dim: int) -> None:
    """q_proj's weight or bias as q_proj and q_gate (`split_query_gate`)."""
    tensor = weights.pop(name)
    weights[name], weights[name.replace("q_proj", "q_gate")] = split_query_gate(
        tensor if isinstance(tensor, torch.Tensor) else tensor[:], head_dim
    )


def split_query_gate(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's output rows (per head: head_dim of query, then head_dim of gate) as the query's and the gate's."""
    per_head = rows.view(-1, 2, head_dim, *rows.shape[1:])
    return per_head[:, 0].reshape(-1, *rows.shape[1:]), per_head[:, 1].reshape(-1, *rows.shape[1:])
