"""Llama / Qwen2 / Qwen3 decoder on packed inputs (no padding), our own code over plain tensors.

Input is one packed sequence of `[num_tokens]` ids and positions covering every request of the
step; request boundaries live in the attention backend's plan. Projections are fused at load
(q|k|v and gate|up), Qwen2 adds a qkv bias, Qwen3 a per-head RMSNorm on q and k before rotary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from kernels import native
from kernels.attention import AttentionBackend
from kernels.decode_layers import DecodeLayers, LayerTensors
from kernels.ops import (LinearWeight, add_rms_norm, apply_rotary, linear, pack_linear_weight, rms_norm,
                         rope_cos_sin_cache, rope_inv_freq, silu_and_mul)
from kernels.panel_linear import PanelWeight
from procs.worker.loader import ModelConfig, ModelLoadError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: LinearWeight  # [(H + 2 * KVH) * D, hidden]; projections are in `pack_linear_weight` form
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: LinearWeight  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: LinearWeight
    down_bias: torch.Tensor | None


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, max_positions: int,
                 dtype: torch.dtype, device: torch.device, quantization: str = "none"):
        self.config = config
        self.dtype = dtype
        self.device = device
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        take = _WeightTaker(weights, dtype, device, quantization)
        self.embed = take("model.embed_tokens.weight")
        self.layers = [self._layer(take, i) for i in range(config.num_layers)]
        self.final_norm = take("model.norm.weight")
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            self.lm_head = pack_linear_weight(self.embed, quantization)  # a packed copy where packing applies
        else:
            self.lm_head = pack_linear_weight(take("lm_head.weight"), quantization)
        if weights:
            raise ModelLoadError(f"unexpected tensors in checkpoint: {', '.join(sorted(weights)[:5])}")
        if self.embed.shape != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match config "
                                 f"({config.vocab_size}, {config.hidden_size})")
        rope = config.rope
        inv_freq = rope_inv_freq(config.head_dim, rope.theta, rope.kind, rope.factor, rope.low_freq_factor,
                                 rope.high_freq_factor, rope.original_max_position_embeddings)
        cos, sin = rope_cos_sin_cache(inv_freq, max_positions)
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)
        # Decode-only steps on the cpu attention backend run every layer in one C call where the layers
        # allow it (panel weights, no q/k norm): same kernels, same tokens, no Python between them.
        self.fuse_decode_layers = native.available() and not config.qk_norm and all(
            isinstance(w, PanelWeight) for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self._decode_layers: tuple[AttentionBackend, DecodeLayers] | None = None

    def _layer(self, take: "_WeightTaker", i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        cfg = self.config
        return LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=take.linear_weight([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                    p + "self_attn.v_proj.weight"]),
            qkv_bias=take.cat([p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"])
            if cfg.qkv_bias else None,
            q_norm=take(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=take(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            o=take.linear_weight([p + "self_attn.o_proj.weight"]),
            o_bias=take(p + "self_attn.o_proj.bias") if cfg.o_bias else None,
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=take.linear_weight([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            gate_up_bias=take.cat([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]) if cfg.mlp_bias else None,
            down=take.linear_weight([p + "mlp.down_proj.weight"]),
            down_bias=take(p + "mlp.down_proj.bias") if cfg.mlp_bias else None,
        )

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], **kwargs) -> "LlamaModel":
        return cls(config, dict(tensors), **kwargs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Run the packed tokens; return float32 logits [len(logits_rows), vocab] for the chosen rows."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        cos = self.rope_cos[positions]
        sin = self.rope_sin[positions]
        hidden = self.embed[input_ids]
        heads_qk = cfg.num_heads + cfg.num_kv_heads
        # The residual stream: each sublayer's output is added to `residual` by the norm that follows
        # it (the next sublayer's, or the final norm), one fused add-and-norm per sublayer.
        residual = hidden
        h = rms_norm(hidden, self.layers[0].input_norm, eps)
        paged = attention.paged_decode() if self.fuse_decode_layers else None
        if paged is not None:
            h = self._decode_layers_on(attention).run(h, residual, cos, sin, *paged)
            return None if logits_rows is None else self.lm_head_logits(h[logits_rows])
        for index, layer in enumerate(self.layers):
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads_qk, cfg.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :cfg.num_heads], layer.q_norm, eps),
                                rms_norm(qk[:, cfg.num_heads:], layer.k_norm, eps)), dim=1)
            qk = apply_rotary(qk, cos, sin)  # q and k heads rotated in one call
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
            attended = attention.forward(q, k, v, index)
            out = linear(attended.reshape(num_tokens, self.q_size), layer.o, layer.o_bias)
            h, residual = add_rms_norm(out, residual, layer.post_norm, eps)
            gate_up = linear(h, layer.gate_up, layer.gate_up_bias)
            out = linear(silu_and_mul(gate_up), layer.down, layer.down_bias)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            h, residual = add_rms_norm(out, residual, next_norm, eps)
        if logits_rows is None:
            return None
        return self.lm_head_logits(h[logits_rows])  # h: the final norm of every row

    def _decode_layers_on(self, attention: AttentionBackend) -> DecodeLayers:
        """The fused call over this backend's KV pools, built on first use."""
        if self._decode_layers is None or self._decode_layers[0] is not attention:
            cfg, cache = self.config, attention.kv_cache
            norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
            layers = [LayerTensors(layer.qkv, layer.qkv_bias, layer.o, layer.o_bias, layer.gate_up, layer.gate_up_bias,
                                   layer.down, layer.down_bias, layer.post_norm, next_norm, cache.k[i], cache.v[i])
                      for i, (layer, next_norm) in enumerate(zip(self.layers, norms))]
            self._decode_layers = (attention, DecodeLayers(
                layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                intermediate=cfg.intermediate_size, page_size=cache.page_size, eps=cfg.rms_norm_eps,
                scale=attention.scale))
        return self._decode_layers[1]

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()


class _WeightTaker:
    """Pops named tensors from a checkpoint dict, converting dtype/device; clear error when missing."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 quantization: str):
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.quantization = quantization

    def _pop(self, name: str) -> torch.Tensor:
        try:
            return self.weights.pop(name)
        except KeyError:
            raise ModelLoadError(f"checkpoint lacks tensor {name}") from None

    def __call__(self, name: str) -> torch.Tensor:
        return self._pop(name).to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self._pop(n) for n in names], dim=0).to(device=self.device, dtype=self.dtype).contiguous()

    def linear_weight(self, names: list[str]) -> LinearWeight:
        """The named projections fused along the output dimension, in `linear`'s packed form."""
        return pack_linear_weight(self.cat(names), self.quantization)
