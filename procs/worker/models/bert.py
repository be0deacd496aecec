"""BERT-style encoders: `BertModel` and `XLMRobertaModel` (bge, e5, gte-base, all-MiniLM, multilingual-e5),
served by the pooling runner only. Our own code over plain tensors, as transformers' reference path
computes them: word + absolute position + token-type embeddings and a LayerNorm, then per layer
bidirectional multi-head attention (q, k, v and output projections with biases), a residual LayerNorm,
an MLP (GELU) and another residual LayerNorm (post-norm). No rotary embedding and no LM head.

An encoder's attention is not causal: every token of an input attends to every other, so an input runs
whole in one step (the scheduler's `whole_prompts`, SCHEDULING.md section 11), its K/V written to the
paged pool like a decoder's and attended by the same backends with `causal` off. Positions are the
packed rows' own (0.. per input; a RoBERTa's start past its padding index, `position_offset`). An
input's token types follow its ids as BERT's tokenizers write a pair ([CLS] a [SEP] b [SEP]): type 0 up
to its first [SEP], 1 after it, where the tokenizer gives token types (a RoBERTa's gives none: all 0).
(So a single text that holds the separator token itself is read as a pair, where its tokenizer would
have given it type 0 throughout.)

A cross-encoder (`BertForSequenceClassification`, `XLMRobertaForSequenceClassification`) is the encoder
and a head on its [CLS] state (`classify`): BERT's pooler (dense, tanh) then its classifier, or a
RoBERTa's classifier (dense, tanh, out_proj); the pooling runner pools [CLS] and asks the head for the
logit of the pair.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchserve.kernels.attention import AttentionBackend
from batchserve.kernels.rope import RotaryTables
from batchserve.procs.worker.lora.slots import LoraSlots
from batchserve.procs.worker.models.base import ModelConfig, RankHeads, Weight, config_path
from batchserve.procs.worker.models.weights import WeightTaker
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec
from batchserve.shared.rope import RopeConfig

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig(ModelConfig):
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0  # a RoBERTa's positions start at padding_idx + 1
    # a cross-encoder's [SEP]: a pair's second text follows the first one (-1: none, every token type 0)
    sep_token_id: int = -1


@dataclass
class EncoderLayer:
    qkv: Any  # ColumnParallelLinear, q | k | v with biases
    o: Any
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm (weight, bias) after attention's residual add
    up: Any
    down: Any
    mlp_norm: tuple[torch.Tensor, torch.Tensor]


class BertModel:
    """`BertModel` (and its encoder inside a checkpoint that prefixes it `bert.`); a `CausalLM` in shape
    (`procs.worker.models.base`) whose `hidden_states` is all the pooling runner asks of it."""

    PREFIXES = ("bert.", "")  # where a checkpoint keeps the encoder's tensors
    # An embedder's input is one text, all type 0 as the tokenizer gives it, whatever [SEP]s it holds (a chat
    # template's rendering may hold several); only a cross-encoder's is a pair.
    PAIRS = False

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], spec: ModelSpec) -> BertConfig:
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden_act {act!r} in {config_path(spec)}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"position_embedding_type {raw['position_embedding_type']!r} in {config_path(spec)}: "
                f"absolute positions only"
            )
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        return BertConfig(
            vocab_size=spec.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            rms_norm_eps=0.0,
            tie_word_embeddings=False,
            rope=RopeConfig(),
            lm_head=False,
            bidirectional=True,
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            position_offset=cls.position_offset(raw),
            sep_token_id=sep_token_id(spec) if cls.PAIRS else -1,
        )

    @staticmethod
    def position_offset(raw: dict[str, Any]) -> int:
        return 0

    @classmethod
    def from_tensors(
        cls,
        config: BertConfig,
        tensors: Iterable[tuple[str, Weight]],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str = "none",
        tp: TensorParallel | None = None,
    ) -> BertModel:
        return cls(
            config,
            dict(tensors),
            max_positions=max_positions,
            dtype=dtype,
            device=device,
            quantization=quantization,
            tp=tp or TensorParallel(),
        )

    def __init__(
        self,
        config: BertConfig,
        weights: dict[str, Weight],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str,
        tp: TensorParallel,
    ):
        if tp.world_size > 1:
            raise ModelLoadError("BERT-style encoders run with tensor_parallel_size 1")
        self.config, self.tp = config, tp
        self.heads = RankHeads.of(config, tp)
        # the runner reads the rope's switches (none): an encoder's positions are embeddings, not rotations
        self.rope = RotaryTables(RopeConfig(), config.head_dim, 1, device=device, dtype=dtype)
        prefix = next((p for p in self.PREFIXES if p + "embeddings.word_embeddings.weight" in weights), None)
        if prefix is None:
            raise ModelLoadError("checkpoint lacks tensor embeddings.word_embeddings.weight (a BERT-style encoder's)")
        self.prefix = prefix
        take = WeightTaker(weights, dtype, device, quantization)
        emb = prefix + "embeddings."
        self.word = take(emb + "word_embeddings.weight")
        self.positions = take(emb + "position_embeddings.weight")
        self.token_types = take(emb + "token_type_embeddings.weight")
        self.embed_norm = self._norm(take, emb + "LayerNorm")
        self.layers = [self._layer(take, f"{prefix}encoder.layer.{i}.") for i in range(config.num_layers)]
        self._take_head(take)
        for name in [n for n in weights if n.startswith(prefix + "pooler.")]:
            take.skip(name)  # BERT's pooler (a dense + tanh on [CLS]): sentence-transformers pools itself
        if weights:
            raise ModelLoadError(f"unexpected tensors in checkpoint: {', '.join(sorted(weights)[:5])}")

    def _take_head(self, take: WeightTaker) -> None:
        """A cross-encoder's classification head, taken before the leftovers are refused (none here)."""

    def _layer(self, take: WeightTaker, layer: str) -> EncoderLayer:
        attn = layer + "attention."
        qkv = [(attn + f"self.{part}", None) for part in ("query", "key", "value")]
        return EncoderLayer(
            qkv=take.column(qkv, True),
            o=take.row(attn + "output.dense", None, True, self.tp),
            attn_norm=self._norm(take, attn + "output.LayerNorm"),
            up=take.column([(layer + "intermediate.dense", None)], True),
            down=take.row(layer + "output.dense", None, True, self.tp),
            mlp_norm=self._norm(take, layer + "output.LayerNorm"),
        )

    @staticmethod
    def _norm(take: WeightTaker, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return take(name + ".weight"), take(name + ".bias")

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """Every packed token's last hidden state [num_tokens, hidden] (each input whole, one segment)."""
        cfg = self.config
        h = (
            self.word[input_ids]
            + self.positions[positions + cfg.position_offset]
            + self._token_types(input_ids, positions)
        )
        h = self._layer_norm(h, self.embed_norm)
        act = ACTIVATIONS[cfg.hidden_act]
        tokens, width = h.shape[0], self.heads.num_heads * cfg.head_dim
        for index, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h).view(tokens, 3, self.heads.num_heads, cfg.head_dim).unbind(1)
            attended = attention.forward(q, k, v, index).reshape(tokens, width)
            h = self._layer_norm(layer.o(attended) + h, layer.attn_norm)
            h = self._layer_norm(layer.down(act(layer.up(h))) + h, layer.mlp_norm)
        return h

    def _token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's type embedding: a cross-encoder's 1 past its input's first [SEP] (a pair's second text),
        else 0. A row starts where the positions do not run on from the token before (inputs are whole: from 0)."""
        sep = self.config.sep_token_id
        if sep < 0 or self.token_types.shape[0] < 2:
            return self.token_types[0]
        is_sep = (input_ids == sep).to(torch.int64)
        before = torch.cumsum(is_sep, 0) - is_sep  # [SEP]s before each token, from the step's first
        new_row = torch.ones_like(positions, dtype=torch.bool)
        new_row[1:] = positions[1:] != positions[:-1] + 1
        row = torch.cumsum(new_row.to(torch.int64), 0) - 1
        return self.token_types[((before - before[new_row][row]) > 0).to(torch.int64)]

    def _layer_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), norm[0], norm[1], self.config.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        raise ModelLoadError("a BERT-style encoder has no LM head: it is served by the pooling runner")

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ModelLoadError("a BERT-style encoder has no LM head: it is served by the pooling runner")

    def take_expert_load(self) -> np.ndarray | None:
        return None

    def enable_lora(self, slots: LoraSlots) -> LoraSlots:
        raise ModelLoadError("a BERT-style encoder does not run LoRA adapters")


class XLMRobertaModel(BertModel):
    """`XLMRobertaModel` (and `RobertaModel`): BERT's layers under `roberta.`, positions from padding_idx + 1."""

    PREFIXES = ("roberta.", "")

    @staticmethod
    def position_offset(raw: dict[str, Any]) -> int:
        return int(raw.get("pad_token_id", 1)) + 1


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder: the encoder (`bert.`), its pooler (dense, tanh) on [CLS], the classifier."""

    PAIRS = True

    def _take_head(self, take: WeightTaker) -> None:
        self.pooler = take.column([(self.prefix + "pooler.dense", None)], True)
        self.classifier = take.column([("classifier", None)], True)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """The logits [rows, labels] of the inputs' [CLS] states [rows, hidden]."""
        return self.classifier(torch.tanh(self.pooler(cls_states)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A RoBERTa cross-encoder: the encoder (`roberta.`), then its classifier (dense, tanh, out_proj) on [CLS]."""

    PAIRS = True

    def _take_head(self, take: WeightTaker) -> None:
        self.dense = take.column([("classifier.dense", None)], True)
        self.out_proj = take.column([("classifier.out_proj", None)], True)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_states)))


def sep_token_id(spec: ModelSpec) -> int:
    """The id of the separator a pair's second text follows, where the tokenizer gives token types (BERT's
    do, a RoBERTa's do not: then every token is type 0); -1 otherwise."""
    try:
        tokenizer = spec.load_tokenizer()
    except ModelLoadError:  # no tokenizer files: token ids come from the client, one text each
        return -1
    if "token_type_ids" not in tokenizer.model_input_names or tokenizer.sep_token_id is None:
        return -1
    return int(tokenizer.sep_token_id)
