"""The Llama decoder on packed inputs (no padding), our own code over plain tensors, and the Llama
family's switches (`LlamaConfig`), which the Qwen2, Qwen3 and Mistral classes set from their configs.

Input is one packed sequence of `[num_tokens]` ids and positions covering every request of the
step; request boundaries live in the attention backend's plan. Projections are fused at load
(q|k|v and gate|up); a config may bias them and norm q and k per head before rotary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from kernels import native
from kernels.attention import AttentionBackend
from kernels.decode_layers import DecodeLayers, LayerTensors
from kernels.ops import add_rms_norm, apply_rotary, rms_norm, rope_cos_sin_cache, rope_inv_freq, silu_and_mul
from kernels.panel_linear import PanelWeight
from procs.worker.models.base import ModelConfig, RankHeads, Weight, config_path
from procs.worker.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from procs.worker.parallel import TensorParallel
from shared.model import ModelLoadError, ModelSpec


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Which projections carry a bias, and whether q and k are RMS-normed per head."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, raw: dict[str, Any], spec: ModelSpec, **switches: Any) -> LlamaConfig:
        """The common fields and an architecture's `switches`; the MLP is SiLU-gated in every one."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r} in {config_path(spec)}")
        return super().from_hf(raw, spec, **switches)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: ColumnParallelLinear  # q | k | v: [(H + 2 * KVH) * D, hidden]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: RowParallelLinear
    post_norm: torch.Tensor
    gate_up: ColumnParallelLinear  # gate | up: [2 * intermediate, hidden]
    down: RowParallelLinear


class LlamaModel:
    """`LlamaForCausalLM`; a `CausalLM` (procs.worker.models.base)."""

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        # attention_bias biases q, k, v and o; mlp_bias gate, up and down
        bias = bool(raw.get("attention_bias", False))
        return LlamaConfig.from_hf(raw, spec, qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))

    @classmethod
    def from_tensors(cls, config: LlamaConfig, tensors: Iterable[tuple[str, Weight]], *, max_positions: int,
                     dtype: torch.dtype, device: torch.device, quantization: str = "none",
                     tp: TensorParallel | None = None) -> LlamaModel:
        return cls(config, dict(tensors), max_positions=max_positions, dtype=dtype, device=device,
                   quantization=quantization, tp=tp)

    def __init__(self, config: LlamaConfig, weights: dict[str, Weight], *, max_positions: int,
                 dtype: torch.dtype, device: torch.device, quantization: str = "none",
                 tp: TensorParallel | None = None):
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.heads = RankHeads.of(config, tp)
        self.q_size = self.heads.num_heads * config.head_dim
        self.kv_size = self.heads.num_kv_heads * config.head_dim
        take = _WeightTaker(weights, dtype, device, quantization)
        embed_shape = take.shape("model.embed_tokens.weight")
        if embed_shape != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(f"embedding shape {embed_shape} does not match config "
                                 f"({config.vocab_size}, {config.hidden_size})")
        vocab_start, vocab_rows = tp.vocab_shard(config.vocab_size)
        vocab = slice(vocab_start, vocab_start + vocab_rows)
        self.embed = VocabParallelEmbedding(take("model.embed_tokens.weight", rows=vocab, pad_rows=vocab_rows),
                                            vocab_start, tp)
        self.intermediate = tp.split(config.intermediate_size, "intermediate_size")
        self.layers = [self._layer(take, i) for i in range(config.num_layers)]
        self.final_norm = take("model.norm.weight")
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            lm_head = self.embed.weight
        else:
            lm_head = take("lm_head.weight", rows=vocab, pad_rows=vocab_rows)
        self.lm_head = ParallelLMHead(lm_head, config.vocab_size, quantization, tp)
        if weights:
            raise ModelLoadError(f"unexpected tensors in checkpoint: {', '.join(sorted(weights)[:5])}")
        rope = config.rope
        inv_freq = rope_inv_freq(config.head_dim, rope.theta, rope.kind, rope.factor, rope.low_freq_factor,
                                 rope.high_freq_factor, rope.original_max_position_embeddings)
        cos, sin = rope_cos_sin_cache(inv_freq, max_positions)
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)
        # Decode-only steps on the cpu attention backend run every layer in one C call where the layers
        # allow it (panel weights, no q/k norm, one rank: the call has no all-reduce between layers):
        # same kernels, same tokens, no Python between them.
        self.fuse_decode_layers = native.available() and not config.qk_norm and tp.world_size == 1 and all(
            isinstance(proj.weight, PanelWeight)
            for layer in self.layers for proj in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self._decode_layers: tuple[AttentionBackend, DecodeLayers] | None = None

    def _layer(self, take: _WeightTaker, i: int) -> LayerWeights:
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        cfg, heads, tp = self.config, self.heads, self.tp
        q = _head_rows(heads.q, cfg.head_dim)
        kv = _head_rows(heads.kv, cfg.head_dim)
        return LayerWeights(
            input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
            qkv=take.column([(attn + "q_proj", q), (attn + "k_proj", kv), (attn + "v_proj", kv)], cfg.qkv_bias),
            q_norm=take(attn + "q_norm.weight") if cfg.qk_norm else None,  # per head_dim: the same on every rank
            k_norm=take(attn + "k_norm.weight") if cfg.qk_norm else None,
            o=take.row(attn + "o_proj", q, cfg.o_bias, tp),
            post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
            gate_up=take.column([(mlp + "gate_proj", self.intermediate), (mlp + "up_proj", self.intermediate)],
                                cfg.mlp_bias),
            down=take.row(mlp + "down_proj", self.intermediate, cfg.mlp_bias, tp),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Run the packed tokens; return float32 logits [len(logits_rows), vocab] for the chosen rows."""
        cfg, heads = self.config, self.heads
        eps = cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        cos = self.rope_cos[positions]
        sin = self.rope_sin[positions]
        hidden = self.embed(input_ids)
        num_heads, num_kv_heads = heads.num_heads, heads.num_kv_heads
        heads_qk = num_heads + num_kv_heads
        # The residual stream: each sublayer's output is added to `residual` by the norm that follows
        # it (the next sublayer's, or the final norm), one fused add-and-norm per sublayer.
        residual = hidden
        h = rms_norm(hidden, self.layers[0].input_norm, eps)
        paged = attention.paged_decode() if self.fuse_decode_layers else None
        if paged is not None:
            h = self._decode_layers_on(attention).run(h, residual, cos, sin, *paged)
            return None if logits_rows is None else self.lm_head_logits(h[logits_rows])
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, num_kv_heads, cfg.head_dim)
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads_qk, cfg.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :num_heads], layer.q_norm, eps),
                                rms_norm(qk[:, num_heads:], layer.k_norm, eps)), dim=1)
            qk = apply_rotary(qk, cos, sin)  # q and k heads rotated in one call
            q, k = qk[:, :num_heads], qk[:, num_heads:]
            attended = attention.forward(q, k, v, index)
            out = layer.o(attended.reshape(num_tokens, self.q_size))
            h, residual = add_rms_norm(out, residual, layer.post_norm, eps)
            out = layer.down(silu_and_mul(layer.gate_up(h)))
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
            layers = [LayerTensors(layer.qkv.weight, layer.qkv.bias, layer.o.weight, layer.o.bias, layer.gate_up.weight,
                                   layer.gate_up.bias, layer.down.weight, layer.down.bias, layer.post_norm, next_norm,
                                   cache.k[i], cache.v[i])
                      for i, (layer, next_norm) in enumerate(zip(self.layers, norms))]
            self._decode_layers = (attention, DecodeLayers(
                layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                intermediate=cfg.intermediate_size, page_size=cache.page_size, eps=cfg.rms_norm_eps,
                scale=attention.scale))
        return self._decode_layers[1]

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _head_rows(heads: slice, head_dim: int) -> slice:
    """The rows of a projection's output that hold `heads`."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


class _WeightTaker:
    """Pops named tensors from a checkpoint dict, reading only this rank's rows or columns of them,
    converting dtype/device; clear error when missing."""

    def __init__(self, weights: dict[str, Weight], dtype: torch.dtype, device: torch.device,
                 quantization: str):
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.quantization = quantization

    def shape(self, name: str) -> tuple[int, ...]:
        weight = self._get(name)
        return tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight.get_shape())

    def _get(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise ModelLoadError(f"checkpoint lacks tensor {name}") from None

    def __call__(self, name: str, *, rows: slice | None = None, cols: slice | None = None,
                 pad_rows: int = 0) -> torch.Tensor:
        """Tensor `name` (its `rows`, or its `cols` of every row), zero rows appended up to `pad_rows`."""
        weight = self._get(name)
        del self.weights[name]
        tensor = weight[rows] if rows is not None else weight[:, cols] if cols is not None else weight[:]
        tensor = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        if tensor.shape[0] < pad_rows:
            padding = tensor.new_zeros((pad_rows - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat((tensor, padding))
        return tensor

    def column(self, projections: list[tuple[str, slice]], bias: bool) -> ColumnParallelLinear:
        """The named projections' output `rows` (`<name>.weight`, and `<name>.bias` with `bias`), fused
        along the output."""
        biases = [self(name + ".bias", rows=rows) for name, rows in projections] if bias else None
        return ColumnParallelLinear([self(name + ".weight", rows=rows) for name, rows in projections], biases,
                                    self.quantization)

    def row(self, projection: str, cols: slice, bias: bool, tp: TensorParallel) -> RowParallelLinear:
        """The projection's input `cols`, and its whole bias with `bias`."""
        return RowParallelLinear(self(projection + ".weight", cols=cols),
                                 self(projection + ".bias") if bias else None, self.quantization, tp)
