"""`GptOssForCausalLM` (gpt-oss-20b and -120b): the Llama decoder with OpenAI's switches (`LlamaConfig`):
biased q, k, v and o projections, a learned attention sink per head in every softmax (`self_attn.sinks`),
sliding-window layers (128 tokens) alternating with global ones (`layer_types`), yarn rope, and a mixture
of experts in every layer whose router has a bias and whose experts are biased and gated by a clamped
SwiGLU (`kernels.moe.ClampedSwiGLU`).

Its experts lie in transformers' GptOssExperts layout: `mlp.experts.gate_up_proj` [experts, hidden, 2 I]
with gate and up interleaved (gate the even columns, up the odd ones), `gate_up_proj_bias` [experts, 2 I]
likewise, `down_proj` [experts, I, hidden], `down_proj_bias` [experts, hidden]; the router is `mlp.router`.
The released checkpoints quantize the experts to MXFP4 (`quantization_config.quant_method: mxfp4`,
`*_blocks` and `*_scales` for `gate_up_proj` and `down_proj`, [out, in] rows): de-quantized at load
(`procs.worker.models.mxfp4`), fp32 on the CPU, the served dtype elsewhere. The model's routing takes the
softmax of the top k's logits, which is the renormalised top k of the softmax over all (`kernels.moe.route`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from batchserve.kernels.moe import ClampedSwiGLU, pack_experts
from batchserve.procs.worker.models import mxfp4
from batchserve.procs.worker.models.base import FULL, SLIDING, Weight, config_path, sliding_windows, with_defaults
from batchserve.procs.worker.models.llama import LlamaConfig, LlamaModel
from batchserve.procs.worker.models.moe import MoEConfig, SparseMoeBlock, expert_shard, num_experts
from batchserve.procs.worker.models.weights import WeightTaker
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec

# transformers' GptOssConfig defaults for the keys read here (its rope: yarn x32 over 4096 positions)
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-5,
    "head_dim": 64,
    "tie_word_embeddings": False,
    "rope_theta": 150000.0,
}
DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class GptOssModel(LlamaModel):
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        raw = _without_mxfp4(with_defaults(raw, GPT_OSS_DEFAULTS), spec)
        layers = int(raw["num_hidden_layers"])
        if raw.get("layer_types") is None:
            raw["layer_types"] = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
        if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
            raw["rope_parameters"] = DEFAULT_ROPE
        moe = MoEConfig.from_hf(
            raw,
            config_path(spec),
            num_layers=layers,
            num_experts=num_experts(raw, 128),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
        activation = ClampedSwiGLU(alpha=float(raw["swiglu_alpha"]), limit=float(raw["swiglu_limit"]))
        bias = bool(raw["attention_bias"])
        return LlamaConfig.from_hf(
            raw,
            spec,
            qkv_bias=bias,
            o_bias=bias,
            attn_sinks=True,
            moe=replace(moe, router_bias=True, activation=activation),
            windows=sliding_windows(raw, spec),
        )

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
        if quantization != "none":
            raise ModelLoadError(
                f"--quantization {quantization}: gpt-oss's experts (a clamped SwiGLU) run in torch, "
                f"which has no {quantization} experts; serve it unquantized"
            )
        return super().from_tensors(
            config, tensors, max_positions=max_positions, dtype=dtype, device=device, quantization=quantization, tp=tp
        )

    def _moe_block(self, take: WeightTaker, layer: str) -> SparseMoeBlock:
        moe, hidden, tp = self.config.moe, self.config.hidden_size, self.tp
        assert moe is not None  # gpt-oss's every layer is a mixture of experts (`config_from_hf`)
        experts, inter = expert_shard(moe, tp)
        prefix, size = f"{layer}mlp.experts.", moe.intermediate_size
        gate_up = _experts_weight(take, prefix + "gate_up_proj", (moe.num_experts, hidden, 2 * size), experts)
        down = _experts_weight(take, prefix + "down_proj", (moe.num_experts, size, hidden), experts)
        take.expect(prefix + "gate_up_proj_bias", (moe.num_experts, 2 * size))
        take.expect(prefix + "down_proj_bias", (moe.num_experts, hidden))
        gate_up_bias, down_bias = (
            take(prefix + "gate_up_proj_bias", rows=experts),
            take(prefix + "down_proj_bias", rows=experts),
        )
        gate, up = 2 * torch.arange(inter.start, inter.stop), 2 * torch.arange(inter.start, inter.stop) + 1
        gate_up = torch.cat((gate_up[:, gate], gate_up[:, up]), dim=1)  # de-interleaved: gate | up, as our experts
        gate_up_bias = torch.cat((gate_up_bias[:, gate], gate_up_bias[:, up]), dim=1)
        if not tp.expert_parallel and tp.rank:  # the ranks' partial sums are added: the bias once
            down_bias = torch.zeros_like(down_bias)
        take.expect(f"{layer}mlp.router.weight", (moe.num_experts, hidden))
        router = take(f"{layer}mlp.router.weight", dtype=torch.float32)
        router_bias = take(f"{layer}mlp.router.bias", dtype=torch.float32)
        packed = pack_experts(
            gate_up,
            down[:, :, inter].contiguous(),
            gate_up_bias,
            down_bias,
            first=experts.start,
            quantization=take.quantization,
            activation=moe.activation,
        )
        return SparseMoeBlock(moe, router, router_bias, packed, None, None, tp)


def _without_mxfp4(raw: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """config.json `raw` without an MXFP4 `quantization_config` (the loader de-quantizes what it names);
    any other quantization stays, for `ModelConfig.from_hf` to refuse."""
    quantization = raw.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == mxfp4.QUANT_METHOD:
        return {key: value for key, value in raw.items() if key != "quantization_config"}
    return raw


def _experts_weight(take: WeightTaker, name: str, shape: tuple[int, int, int], experts: slice) -> torch.Tensor:
    """The rank's `experts` of a stacked [experts, in, out] checkpoint tensor as [experts, out, in]: the tensor
    itself, or its MXFP4 `_blocks` and `_scales` ([out, in] rows already) de-quantized."""
    count, fan_in, fan_out = shape
    if not take.has(name + "_blocks"):
        take.expect(name, shape)
        return take.parts(name, [(experts,)])[0].transpose(1, 2)
    (blocks,) = take.parts(name + "_blocks", [(experts,)], dtype=torch.uint8)
    (scales,) = take.parts(name + "_scales", [(experts,)], dtype=torch.uint8)
    weight = mxfp4.dequantize(blocks, scales, name)
    if weight.shape[1:] != (fan_out, fan_in):
        raise ModelLoadError(
            f"MXFP4 tensor {name} de-quantizes to {tuple(weight.shape[1:])} per expert, expected {(fan_out, fan_in)}"
        )
    return weight.to(take.dtype)
