"""The model interface: `CausalLM`, what the worker's model runner and graph runner use of a model,
`Architecture`, what the loader uses of its class (`procs.worker.models.ARCHITECTURES` holds them), and
`ModelConfig`, the config fields every decoder has.

One metadata source: `shared.model.ModelSpec`, which every process resolves at its start, is the one
reading of the model's architecture, vocabulary size, context length and EOS ids; the worker reads
them there too. `ModelConfig` takes the vocabulary size from it and otherwise holds the decoder's
shape, which only the worker needs. Each architecture reads its own fields of config.json
(`Architecture.config_from_hf`) on top of the common ones, read once here (`ModelConfig.from_hf`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from batchserve.kernels.attention import AttentionBackend, AttentionMetadata, plan_step
from batchserve.kernels.recurrent_state import RecurrentShape
from batchserve.kernels.rope import RotaryTables
from batchserve.procs.worker.hf_quantized import scheme_of
from batchserve.procs.worker.lora.slots import LoraSlots
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.messages import ForwardBatch
from batchserve.shared.model import ModelLoadError, ModelSpec
from batchserve.shared.rope import RopeConfig

Config = TypeVar("Config", bound="ModelConfig")
ArchConfig = TypeVar("ArchConfig", bound="ModelConfig")  # an `Architecture`'s own config class
# A checkpoint tensor: a torch.Tensor, or a safetensors slice that reads from the file only the part
# indexed (`weight[a:b]`, `weight[:, a:b]`, `weight[:]`).
Weight = Any


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape; an architecture's own fields go in a subclass."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    windows: tuple[int, ...] = ()  # each layer's sliding window, 0: the whole context (empty: no layer slides)
    attn_scale: float | None = None  # scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # attention scores soft-capped at this (Gemma 2); 0: not
    linear_layers: tuple[int, ...] = ()  # a hybrid model's linear-attention layers: no KV, a state per request
    recurrent: RecurrentShape | None = None  # their state's shape (`kernels.recurrent_state`)
    lm_head: bool = True  # False: loaded without its LM head (the pooling runner), `forward` gives no logits
    bidirectional: bool = False  # an encoder (BERT): every token attends to every other of its input

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep KV in the paged pool, in the pool's order."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_hf(cls: type[Config], raw: dict[str, Any], spec: ModelSpec, **fields: Any) -> Config:
        """The common fields of config.json `raw`, plus the subclass's `fields`; ModelLoadError for a
        quantized checkpoint of a method the loader does not serve (`procs.worker.hf_quantized`)."""
        quantization = raw.get("quantization_config")
        if quantization:
            scheme_of(quantization, config_path(spec))
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        try:
            rope = RopeConfig.from_hf(raw, config_path(spec))
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        if "windows" not in fields:  # an architecture's own reading, else `layer_types`
            fields["windows"] = sliding_windows(raw, spec)
        return cls(
            vocab_size=spec.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=rope,
            **fields,
        )


SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' `layer_types`


def sliding_windows(
    raw: dict[str, Any], spec: ModelSpec, *, every_layer: bool = False, default: int | None = None
) -> tuple[int, ...]:
    """Each layer's attention window (0: the whole context) as transformers reads config.json: the layers
    `layer_types` calls sliding slide, or, with `every_layer` (Mistral, Mixtral, Phi-3, Qwen3-MoE), all
    of them; the window is `sliding_window` (`default` when the key is absent), none when it is null or 0
    or `use_sliding_window` is false (Qwen's switch). A window that spans the served context masks
    nothing and counts as none. Empty: no layer slides."""
    layers, window = int(raw["num_hidden_layers"]), raw.get("sliding_window", default)
    if not window or raw.get("use_sliding_window") is False:
        return ()
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
            raise ModelLoadError(f"layer_types in {config_path(spec)}: {layers} of {SLIDING!r} or {FULL!r} expected")
        windows = tuple(int(window) if kind == SLIDING else 0 for kind in layer_types)
    elif every_layer:
        windows = (int(window),) * layers
    elif raw.get("use_sliding_window"):
        raise ModelLoadError(
            f"use_sliding_window without layer_types in {config_path(spec)}: which layers slide "
            f"is not said (transformers 5 writes layer_types)"
        )
    else:
        return ()
    windows = tuple(w if w < spec.context_length else 0 for w in windows)
    return windows if any(windows) else ()


@dataclass(frozen=True)
class RankHeads:
    """The attention heads one tensor-parallel rank computes and the KV heads it caches, as slices of
    the model's heads. Query heads split evenly; KV heads split evenly too when there are at least as
    many as ranks, else each KV head is replicated on world / num_kv_heads ranks (as vLLM does), the
    one its rank's query heads attend with."""

    q: slice
    kv: slice
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.q.stop - self.q.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv.stop - self.kv.start

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> RankHeads:
        world, heads, kv_heads = tp.world_size, config.num_heads, config.num_kv_heads
        q = tp.split(heads, "num_attention_heads")  # ValueError naming it when it does not divide
        if kv_heads >= world and kv_heads % world or kv_heads < world and world % kv_heads:
            raise ModelLoadError(
                f"num_key_value_heads {kv_heads} and tensor_parallel_size {world}: one must "
                f"divide the other (KV heads are split, or replicated when fewer than the ranks)"
            )
        if kv_heads >= world:
            kv = tp.split(kv_heads, "num_key_value_heads")
        else:
            head = tp.rank // (world // kv_heads)
            kv = slice(head, head + 1)
        return cls(q=q, kv=kv, head_dim=config.head_dim)


def with_defaults(raw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """config.json `raw` with `defaults` (an architecture's transformers config class defaults) for the keys
    it lacks: a missing key means what transformers makes of it."""
    return {**defaults, **raw}


def config_path(spec: ModelSpec) -> str:
    """Where the config errors point."""
    return str(spec.model_dir / "config.json")


class CausalLM(Protocol):
    """A decoder-only model over one packed sequence of tokens (every request of a step; the request
    boundaries live in the attention backend's plan), as its `Architecture.from_tensors` builds it. An
    encoder has this shape too (its `forward`, `lm_head_logits` and `enable_lora` refuse: the pooling
    runner asks it for `hidden_states` alone)."""

    @property
    def config(self) -> ModelConfig:
        """Its architecture's reading of config.json (read-only here: a model holds its own subclass)."""
        ...

    @property
    def heads(self) -> RankHeads:
        """What this rank computes of the attention (all of it with one rank)."""
        ...

    @property
    def rope(self) -> RotaryTables:
        """`forward`'s positions are rows of these (`RotaryTables.rows`)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Run the packed tokens (their K/V written, attention computed, through `attention`'s plan) at
        `positions` (each token's row of `rope`: its position, unless the rope switches factors); float32
        logits [len(logits_rows), vocab] of the chosen token rows, None without rows."""
        ...

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """`forward` without the LM head: every packed token's final-normed hidden state [num_tokens, hidden]
        (the pooling runner's input)."""
        ...

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden rows: the last step of `forward`, which calls it."""
        ...

    def take_expert_load(self) -> np.ndarray | None:
        """A mixture of experts: the tokens routed to each expert of each MoE layer [layers, experts]
        since the last call (the counters restart); None for a dense model."""
        ...

    def enable_lora(self, slots: LoraSlots) -> LoraSlots:
        """LoRA pairs on the model's projections, read from `slots` (returned), each cut as this rank's share
        (`procs.worker.lora.slots`); ModelLoadError where its layers cannot run adapters."""
        ...


class Architecture(Protocol[ArchConfig]):
    """An architecture: the class (its classmethods) that reads its config and builds its `CausalLM`, one
    line in `procs.worker.models.ARCHITECTURES`. `ArchConfig` is its own config class, which its
    `from_tensors` takes from its `config_from_hf`."""

    def config_from_hf(self, raw: dict[str, Any], spec: ModelSpec) -> ArchConfig:
        """This architecture's reading of config.json `raw`; ModelLoadError for what it cannot run
        (`spec.context_length` is the longest request it will be asked to)."""
        ...

    def from_tensors(
        self,
        config: ArchConfig,
        tensors: Iterable[tuple[str, Weight]],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str,
        tp: TensorParallel,
    ) -> CausalLM:
        """The model from a checkpoint's named tensors, each of which it must take (ModelLoadError naming
        a missing or a left-over one), on `device` in `dtype`, for positions below `max_positions`, its
        linear layers packed for `quantization` (`kernels.ops.pack_linear_weight`); `tp`'s rank's share
        of it (`procs.worker.models.layers`), each tensor read only as far as that share needs."""
        ...


def eager_forward(
    model: CausalLM,
    attention: AttentionBackend,
    slots: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    input_ids: np.ndarray,
    positions: np.ndarray,
    kv_locs: np.ndarray,
    logits_rows: np.ndarray,
) -> torch.Tensor | None:
    """One forward pass without a captured graph: `attention` planned for the packed rows (host arrays,
    copied to its device), then `model.forward`; the logits of `logits_rows`, None without rows."""
    to_device = _planned(attention, slots, prefix_lens, extend_lens, kv_locs)
    return model.forward(
        to_device(input_ids), to_device(positions), attention, to_device(logits_rows) if len(logits_rows) else None
    )


def eager_hidden_states(model: CausalLM, attention: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
    """`eager_forward`'s pass over `batch`'s rows without the LM head: every token's final hidden state."""
    to_device = _planned(attention, batch.slots, batch.prefix_lens, batch.extend_lens, batch.kv_locs)
    return model.hidden_states(to_device(batch.input_ids), to_device(batch.positions), attention)


def _planned(
    attention: AttentionBackend, slots: list[int], prefix_lens: list[int], extend_lens: list[int], kv_locs: np.ndarray
) -> Any:
    """`attention` planned for the packed rows; the host-to-device copy of an index array."""
    device = attention.kv_cache.device

    def to_device(a: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device, non_blocking=True)

    plan_step(
        attention,
        AttentionMetadata(
            slots=list(slots), prefix_lens=list(prefix_lens), extend_lens=list(extend_lens), kv_locs=to_device(kv_locs)
        ),
    )
    return to_device
