"""The Llama decoder on packed inputs (no padding), our own code over plain tensors, and the Llama
family's switches (`LlamaConfig`), which the Qwen2, Qwen3, Mistral and mixture-of-experts classes set
from their configs.

Input is one packed sequence of `[num_tokens]` ids and positions covering every request of the
step; request boundaries live in the attention backend's plan. Projections are fused at load
(q|k|v and gate|up); a config may bias them, norm q and k (per head, or over the whole projection) before
rotary and clip them, and replace a layer's MLP by a mixture of experts (`procs.worker.models.moe`).
On the cpu attention backend a step runs every layer in one C call where the layers allow it
(`procs.worker.models.llama_fused`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchserve.kernels.attention import AttentionBackend
from batchserve.kernels.decode_layers import DecodeLayers
from batchserve.kernels.ops import add_rms_norm, apply_rotary, rms_norm, rms_norm_groups
from batchserve.kernels.rope import RotaryTables
from batchserve.procs.worker.lora.slots import LoraSlots, attach
from batchserve.procs.worker.models.base import ModelConfig, RankHeads, Weight, config_path
from batchserve.procs.worker.models.layers import GatedMLP, ParallelLMHead, VocabParallelEmbedding
from batchserve.procs.worker.models.llama_fused import fused_decode_layers, fuses_decode_layers
from batchserve.procs.worker.models.moe import QWEN_EXPERTS, ExpertNames, MoEConfig, SparseMoeBlock, take_moe_block
from batchserve.procs.worker.models.weights import WeightTaker
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec
from batchserve.shared.rope import RopeConfig

QK_NORMS = ("none", "head", "projection")  # per head of head_dim (Qwen3), or over the whole q / k projection (OLMoE)


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Which projections carry a bias, how q and k are normed and clipped, the mixture of experts, and
    Gemma's switches: GELU, (1 + w) norms, a norm on each sublayer's output, scaled embeddings, capped
    logits and the sliding layers' own rope."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"  # one of QK_NORMS
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] (after the norms)
    moe: MoEConfig | None = None
    hidden_act: str = "silu"  # the gated MLP's activation, one of kernels.ops.GATED_ACTIVATIONS
    norm_offset: float = 0.0  # every RMSNorm weight is offset + w (Gemma: 1 + w)
    sandwich_norms: bool = False  # each sublayer's output normed before the residual add (Gemma 2 / 3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    final_softcap: float = 0.0  # logits soft-capped at this (Gemma 2); 0: not
    local_rope: RopeConfig | None = None  # the sliding layers' rope where it differs (Gemma 3)
    local_rope_layers: tuple[int, ...] = ()  # the layers it rotates (sliding ones, whatever their window's span)
    attn_sinks: bool = False  # a learned sink logit per head in each softmax (gpt-oss: self_attn.sinks)
    attn_output_gate: bool = False  # attention's output times sigmoid(a gate projection of h) (Qwen3-Next, 3.5)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], spec: ModelSpec, **switches: Any) -> LlamaConfig:
        """The common fields and an architecture's `switches`; SiLU-gated MLPs unless a switch says."""
        if "hidden_act" not in switches and raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r} in {config_path(spec)}")
        return super().from_hf(raw, spec, **switches)


Mlp = GatedMLP | SparseMoeBlock


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Any  # ColumnParallelLinear, q | k | v: [(H + 2 * KVH) * D, hidden]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Any  # RowParallelLinear
    post_norm: torch.Tensor  # the MLP's input norm (Gemma's pre_feedforward_layernorm)
    mlp: Mlp
    attn_out_norm: torch.Tensor | None = None  # sandwich norms: attention's output (Gemma's post_attention_layernorm)
    mlp_out_norm: torch.Tensor | None = None  # and the MLP's (post_feedforward_layernorm)
    sinks: torch.Tensor | None = None  # [this rank's heads] fp32 attention sink logits (gpt-oss)
    attn_gate: Any = None  # ColumnParallelLinear [H * D, hidden]: attention's output gate (Qwen3-Next, 3.5)
    mixer: Any = None  # a linear layer's token mixer in attention's place (a GatedDeltaNet; qkv and o None)


class LlamaModel:
    """`LlamaForCausalLM`; a `CausalLM` (procs.worker.models.base)."""

    EXPERT_NAMES: ExpertNames = QWEN_EXPERTS  # where a mixture of experts' tensors lie (one per expert)

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> LlamaConfig:
        # attention_bias biases q, k, v and o; mlp_bias gate, up and down
        bias = bool(raw.get("attention_bias", False))
        return LlamaConfig.from_hf(raw, spec, qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))

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
        return cls(
            config,
            dict(tensors if config.lm_head else headless_tensors(tensors)),
            max_positions=max_positions,
            dtype=dtype,
            device=device,
            quantization=quantization,
            tp=tp,
        )

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, Weight],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str = "none",
        tp: TensorParallel | None = None,
    ):
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.heads = RankHeads.of(config, tp)
        self.kv_index = {layer: i for i, layer in enumerate(config.kv_layers)}  # a layer's in the KV pool
        self.q_size = self.heads.num_heads * config.head_dim
        self.kv_size = self.heads.num_kv_heads * config.head_dim
        take = WeightTaker(weights, dtype, device, quantization)
        embed_shape = take.shape("model.embed_tokens.weight")
        if embed_shape != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(
                f"embedding shape {embed_shape} does not match config ({config.vocab_size}, {config.hidden_size})"
            )
        vocab_start, vocab_rows = tp.vocab_shard(config.vocab_size)
        vocab = slice(vocab_start, vocab_start + vocab_rows)
        self.embed = VocabParallelEmbedding(
            take.linear_weight("model.embed_tokens.weight", rows=vocab, pad_rows=vocab_rows),
            vocab_start,
            tp,
            take.dtype,
        )
        sparse = set(config.moe.sparse_layers) if config.moe else set()
        self.intermediate = (
            None if len(sparse) == config.num_layers else tp.split(config.intermediate_size, "intermediate_size")
        )
        self.layers = [self._layer(take, i, i in sparse) for i in range(config.num_layers)]
        self.final_norm = self._norm(take, "model.norm.weight")
        self.lm_head = self._lm_head(take, weights, vocab, vocab_rows, quantization)
        if weights:
            raise ModelLoadError(f"unexpected tensors in checkpoint: {', '.join(sorted(weights)[:5])}")
        self.rope, self.local_rope = self._ropes(max_positions, dtype, device)
        self.fuse_decode_layers = fuses_decode_layers(config, self.rope, tp, self.layers)  # the one C call
        self._decode_layers: tuple[AttentionBackend, int, DecodeLayers] | None = None  # and the adapters' version
        self.lora: LoraSlots | None = None  # the adapters, once `enable_lora` hangs them on the projections

    def _lm_head(
        self, take: WeightTaker, weights: dict[str, Weight], vocab: slice, vocab_rows: int, quantization: str
    ) -> ParallelLMHead | None:
        """This rank's share of the LM head, tied to the embeddings or its own tensor; None: the pooling
        runner's model (`ModelConfig.lm_head`), whose checkpoint's head, if any, is dropped."""
        config, tp = self.config, self.tp
        if not config.lm_head:
            weights.pop("lm_head.weight", None)
            return None
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            return ParallelLMHead(self.embed.weight, config.vocab_size, quantization, tp)
        lm_head = take.linear_weight("lm_head.weight", rows=vocab, pad_rows=vocab_rows)
        return ParallelLMHead(lm_head, config.vocab_size, quantization, tp)

    def _ropes(
        self, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[RotaryTables, RotaryTables | None]:
        """The rope tables, and the sliding layers' own where they differ (Gemma 3; None: not so)."""
        config = self.config
        rope = RotaryTables(config.rope, config.head_dim, max_positions, device=device, dtype=dtype)
        local_rope = (
            None
            if config.local_rope is None
            else RotaryTables(config.local_rope, config.head_dim, max_positions, device=device, dtype=dtype)
        )
        if local_rope is not None and (rope.follows_length or local_rope.follows_length):
            raise ModelLoadError(
                f"a rope that follows the length ({config.rope.kind}) beside the sliding layers' own "
                f"rope is not supported: the two would need rows of their own"
            )
        return rope, local_rope

    def enable_lora(self, slots: LoraSlots) -> LoraSlots:
        """LoRA pairs on every layer's seven projections (`procs.worker.lora.slots`; a mixture of experts' attention
        alone), read from `slots` (returned), each cut as this rank's share of its projection (`slots.shards`)."""
        cfg = self.config
        if ("gate_proj" in slots.served) != (cfg.moe is None):
            raise ModelLoadError("LoRA adapters of a mixture of experts are served on its attention alone")
        self.lora = slots
        q, kv = _head_rows(self.heads.q, cfg.head_dim), _head_rows(self.heads.kv, cfg.head_dim)
        slots.shards = {"q_proj": ("rows", q), "k_proj": ("rows", kv), "v_proj": ("rows", kv), "o_proj": ("cols", q)}
        mlp = self.intermediate
        if cfg.moe is None and mlp is not None:
            slots.shards.update({"gate_proj": ("rows", mlp), "up_proj": ("rows", mlp), "down_proj": ("cols", mlp)})
        attach(self.layers, slots, self.q_size, self.kv_size, 0 if mlp is None else mlp.stop - mlp.start)
        return slots

    def _layer(self, take: WeightTaker, i: int, sparse: bool) -> LayerWeights:
        layer = f"model.layers.{i}."
        attn = layer + "self_attn."
        cfg, heads, tp = self.config, self.heads, self.tp
        q = _head_rows(heads.q, cfg.head_dim)
        kv = _head_rows(heads.kv, cfg.head_dim)

        # a norm per head is the same on every rank; over the projection, each rank takes its heads' share
        def norm_rows(rows: slice) -> slice | None:
            return rows if cfg.qk_norm == "projection" else None

        block = self._mlp(take, layer, sparse)

        def norm(name: str, rows: slice | None = None) -> torch.Tensor:
            return self._norm(take, layer + name, rows)

        sandwich = cfg.sandwich_norms
        return LayerWeights(
            input_norm=norm("input_layernorm.weight"),
            qkv=take.column([(attn + "q_proj", q), (attn + "k_proj", kv), (attn + "v_proj", kv)], cfg.qkv_bias),
            q_norm=norm("self_attn.q_norm.weight", norm_rows(q)) if cfg.qk_norm != "none" else None,
            k_norm=norm("self_attn.k_norm.weight", norm_rows(kv)) if cfg.qk_norm != "none" else None,
            o=take.row(attn + "o_proj", q, cfg.o_bias, tp),
            post_norm=norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
            mlp=block,
            attn_out_norm=norm("post_attention_layernorm.weight") if sandwich else None,
            mlp_out_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
            sinks=take(attn + "sinks", rows=heads.q, dtype=torch.float32) if cfg.attn_sinks else None,
        )

    def _mlp(self, take: WeightTaker, layer: str, sparse: bool) -> Mlp:
        """Layer `layer`'s (prefix `model.layers.{i}.`) MLP: dense, or with `sparse` its mixture of experts."""
        if sparse:
            return self._moe_block(take, layer)
        mlp, cfg = layer + "mlp.", self.config
        assert self.intermediate is not None  # None only when every layer is a mixture of experts
        return GatedMLP(
            take.column([(mlp + "gate_proj", self.intermediate), (mlp + "up_proj", self.intermediate)], cfg.mlp_bias),
            take.row(mlp + "down_proj", self.intermediate, cfg.mlp_bias, self.tp),
            cfg.hidden_act,
        )

    def _moe_block(self, take: WeightTaker, layer: str) -> SparseMoeBlock:
        """Layer `layer`'s (prefix `model.layers.{i}.`) mixture of experts, this rank's share of it."""
        assert self.config.moe is not None  # a sparse layer's model has a mixture of experts
        return take_moe_block(take, layer, self.EXPERT_NAMES, self.config.moe, self.config.hidden_size, self.tp)

    def _norm(self, take: WeightTaker, name: str, rows: slice | None = None) -> torch.Tensor:
        """An RMSNorm weight, offset as the config says (Gemma's 1 + w, added once here in fp32)."""
        offset = self.config.norm_offset
        if not offset:
            return take(name, rows=rows)
        return (take(name, rows=rows, dtype=torch.float32) + offset).to(take.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Run the packed tokens; return float32 logits [len(logits_rows), vocab] for the chosen rows."""
        h = self.hidden_states(input_ids, positions, attention)
        return None if logits_rows is None else self.lm_head_logits(h[logits_rows])

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """Run the packed tokens; every token's final-normed hidden state [num_tokens, hidden]."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        cos, sin = self.rope.lookup(positions)
        hidden = self.embed(input_ids)
        if cfg.embed_scale:
            hidden = hidden * torch.tensor(cfg.hidden_size**0.5, dtype=hidden.dtype)
        # The residual stream: each sublayer's output is added to `residual` by the norm that follows
        # it (the next sublayer's, or the final norm), one fused add-and-norm per sublayer.
        residual = hidden
        h = rms_norm(hidden, self.layers[0].input_norm, eps)
        paged = attention.paged_rows() if self.fuse_decode_layers else None
        if paged is not None:  # LoRA rows too: the call adds their pairs as the layers' Python does
            mask = self.lora.mask if self.lora is not None else None
            return self._decode_layers_on(attention).run(h, residual, cos, sin, *paged, lora_mask=mask)
        local = None if self.local_rope is None else (self.local_rope.cos[positions], self.local_rope.sin[positions])
        for index, layer in enumerate(self.layers):
            rotation = local if local is not None and index in cfg.local_rope_layers else (cos, sin)
            out = self._attention(layer, index, h, *rotation, attention)
            if layer.attn_out_norm is not None:
                out = rms_norm(out, layer.attn_out_norm, eps)
            h, residual = add_rms_norm(out, residual, layer.post_norm, eps)
            out = layer.mlp(h)
            if layer.mlp_out_norm is not None:
                out = rms_norm(out, layer.mlp_out_norm, eps)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            h, residual = add_rms_norm(out, residual, next_norm, eps)
        return h  # the final norm of every row

    def _attention(
        self,
        layer: LayerWeights,
        index: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """The attention sublayer's output (before the residual add); a linear layer's mixer's instead."""
        if layer.mixer is not None:
            return layer.mixer(h, attention.kv_cache.states)
        qk, v = self._qk_v(layer.qkv(h), layer)
        qk = self._rotate(qk, cos, sin)
        q, k = qk[:, : self.heads.num_heads], qk[:, self.heads.num_heads :]
        attended = attention.forward(q, k, v, self.kv_index[index], layer.sinks).reshape(h.shape[0], self.q_size)
        if layer.attn_gate is not None:
            attended = attended * torch.sigmoid(layer.attn_gate(h))
        return layer.o(attended)

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k heads rotated in one call: every dim, or the first `rotary_dim` (partial rotary)."""
        rotary = self.rope.rotary_dim
        if rotary == qk.shape[-1]:
            return apply_rotary(qk, cos, sin)
        return torch.cat((apply_rotary(qk[..., :rotary], cos, sin), qk[..., rotary:]), dim=-1)

    def _qk_v(self, qkv: torch.Tensor, layer: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """q | k heads [tokens, H + KVH, D] normed and clipped as the config says (not yet rotated), and v
        [tokens, KVH, D]; the same arithmetic as the fused decode call's."""
        cfg, heads = self.config, self.heads
        tokens, q_size, kv_size = qkv.shape[0], self.q_size, self.kv_size
        qk, v = qkv[:, : q_size + kv_size], qkv[:, q_size + kv_size :]
        q_norm, k_norm = layer.q_norm, layer.k_norm
        if cfg.qk_norm == "head":
            assert q_norm is not None and k_norm is not None  # loaded as the config's qk_norm says
            qk = torch.cat(
                (
                    rms_norm_groups(qkv[:, :q_size], q_norm, cfg.rms_norm_eps, heads.num_heads),
                    rms_norm_groups(qkv[:, q_size : q_size + kv_size], k_norm, cfg.rms_norm_eps, heads.num_kv_heads),
                ),
                dim=1,
            )
        elif cfg.qk_norm == "projection":
            assert q_norm is not None and k_norm is not None  # loaded as the config's qk_norm says
            kv_replicas = max(1, self.tp.world_size // cfg.num_kv_heads)  # ranks holding each KV head
            qk = torch.cat(
                (
                    self._projection_norm(qkv[:, :q_size], q_norm, 1),
                    self._projection_norm(qkv[:, q_size : q_size + kv_size], k_norm, kv_replicas),
                ),
                dim=1,
            )
        if cfg.clip_qkv is not None:
            qk, v = qk.clamp(-cfg.clip_qkv, cfg.clip_qkv), v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        return (
            qk.view(tokens, heads.num_heads + heads.num_kv_heads, cfg.head_dim),
            v.view(tokens, heads.num_kv_heads, cfg.head_dim),
        )

    def _projection_norm(self, x: torch.Tensor, weight: torch.Tensor, replicas: int) -> torch.Tensor:
        """RMSNorm over a whole projection of which this rank holds columns `x` (its weight's share): the
        squares summed over the ranks, each column counted once (`replicas` ranks hold each)."""
        eps = self.config.rms_norm_eps
        if self.tp.world_size == 1:
            return rms_norm_groups(x, weight, eps, 1)
        width = x.shape[1] * self.tp.world_size // replicas
        squares = self.tp.all_reduce(x.float().pow(2).sum(dim=-1, keepdim=True)) / replicas
        return weight * (x.float() * torch.rsqrt(squares / width + eps)).to(x.dtype)

    def _decode_layers_on(self, attention: AttentionBackend) -> DecodeLayers:
        """The fused call over this backend's KV pools, built on first use and after an adapter load or unload
        (its LoRA pairs are restacked)."""
        version = self.lora.version if self.lora is not None else 0
        if self._decode_layers is None or self._decode_layers[:2] != (attention, version):
            call = fused_decode_layers(self.config, self.layers, self.final_norm, self.intermediate, attention)
            self._decode_layers = (attention, version, call)
        return self._decode_layers[2]

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "a model loaded without its LM head computes no logits"
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def take_expert_load(self) -> np.ndarray | None:
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        if not blocks:
            return None
        load = torch.stack([block.load for block in blocks])
        for block in blocks:
            block.load.zero_()  # in place: the C blocks and captured graphs hold its address
        return load.cpu().numpy()


def headless_tensors(tensors: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """A checkpoint's tensors as a ForCausalLM names them, from a decoder saved without its LM head (a
    `Qwen3Model`: `layers.0...`, `norm.weight`) or with one (whose `lm_head.*` the model then drops)."""
    for name, tensor in tensors:
        yield (name if name.startswith(("model.", "lm_head.")) else "model." + name), tensor


def _head_rows(heads: slice, head_dim: int) -> slice:
    """The rows of a projection's output that hold `heads`."""
    return slice(heads.start * head_dim, heads.stop * head_dim)
