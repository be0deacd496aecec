"""The pooling runner's model head, read from the model's own files: `PoolerConfig`.

A model served by the pooling runner (`--runner pooling`) answers `/v1/embeddings` rather than
generating: each request is one prefill whose final hidden states are pooled into one vector
(SCHEDULING.md section 11). How they are pooled is the model's, never a guess: the wrong pooling gives
vectors that look fine and rank badly. The rule, in order:
- `--pooling` (last | mean | cls), when given, wins (normalising as the files say, else as below);
- a sentence-transformers folder says it: `modules.json` lists a `Pooling` module (its folder's
  `config.json`: `pooling_mode_lasttoken`, `pooling_mode_mean_tokens` or `pooling_mode_cls_token`)
  and, when the vectors are normalised, a `Normalize` module; modules this server does not run (a
  `Dense` projection, max or weighted-mean pooling) are refused at start, naming them;
- otherwise a decoder pools its last token and an encoder its first ([CLS]), and both normalise (what
  Qwen3-Embedding, gte-Qwen2, e5-mistral and bge were trained with; vLLM's defaults).
A sentence-transformers 6 folder whose `sentence_bert_config.json` lists a `message` modality (it does
whenever the tokenizer had a chat template when it was saved) embeds a text as sentence-transformers does
then: as one user message rendered by the chat template (`ChatInput`, the tokenizer's); a cross-encoder
folder that says so is refused, its pairs being messages too.
Matryoshka dimensions (a request's `dimensions`: the vector cut to its first d entries, then
normalised) are allowed where config.json says the model was trained for them: `matryoshka_dimensions`
(the list of allowed sizes) or `is_matryoshka` (any size), as vLLM reads them.

Which runner serves a model (`runner_for`): `--runner`, or with `auto` the pooling runner for a
sentence-transformers folder (it has `modules.json`) or an architecture without an LM head
(`Qwen3Model`, `LlamaModel`, ...), the generate runner otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, cast, get_args

import msgspec
import numpy as np

from batchserve.shared.chat_format import read_chat_template
from batchserve.shared.errors import ModelLoadError, Refusal

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)
Activation = Literal["sigmoid", "identity"]
# sentence-transformers' pooling modes that this server runs, by its 1_Pooling/config.json key
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
# sentence-transformers 6 spells the mode as one string
_ST_MODE_NAMES: dict[str, PoolingType] = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# Encoders (bidirectional: an input runs whole in one step), which pool their first token ([CLS]) by default.
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
# Cross-encoders: an encoder and a classification head on its [CLS], scoring a pair of texts as one input.
CROSS_ENCODER_ARCHITECTURES = (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    "RobertaForSequenceClassification",
)
# Models without an LM head, as their checkpoints name them: served by the pooling runner only.
HEADLESS_ARCHITECTURES = (
    "LlamaModel",
    "MistralModel",
    "Qwen2Model",
    "Qwen3Model",
    *ENCODER_ARCHITECTURES,
    *CROSS_ENCODER_ARCHITECTURES,
)
# A cross-encoder's activation on its logit, by sentence-transformers' `activation_fn` (its default for one
# label: sigmoid)
ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


# sentence-transformers' message format by model type, before it reads the template (its
# KNOWN_MODEL_TYPES_MESSAGE_FORMATS), and the template text that says structured content (its _infer_format)
_ST_FLAT_MODEL_TYPES = ("apertus", "deepseek_v3", "gpt_oss", "minicpm3", "seed_oss")
_ST_STRUCTURED_PATTERNS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")
# chat-template kwargs that size the tokenization rather than feed the template: the cut ones are refused
# (this server refuses an input too long rather than cutting it), the others change no vector
_ST_CUT_KWARGS = ("truncation", "max_length")
_ST_SIZE_KWARGS = ("padding", "return_tensors", "restore_suffix")


class ChatInput(msgspec.Struct, frozen=True, kw_only=True):
    """How sentence-transformers 6 embeds a text for a folder with the `message` modality: the one user
    message `message(text)` rendered by the chat template with `template_kwargs` (its saved
    `processing_kwargs["chat_template"]`; no generation prompt unless they ask for one), the rendering
    tokenized without special tokens (the template writes those it wants)."""

    structured: bool  # the content as [{"type": "text", "text": ...}], else the text itself ("flat")
    template_kwargs: dict[str, Any] = {}

    def message(self, text: str) -> list[dict[str, Any]]:
        content: Any = [{"type": "text", "text": text}] if self.structured else text
        return [{"role": "user", "content": content}]


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the pooling runner turns a prompt's final hidden states into its vector: an embedding, or a
    cross-encoder's (`kind` "classify") logit of the pair its input holds, the score after `activation`."""

    pooling: PoolingType
    normalize: bool  # unit length (L2), after the Matryoshka cut
    matryoshka: tuple[int, ...] | bool = False  # allowed `dimensions`: the listed sizes, True: any size, False: none
    source: str = "default"  # where the rule came from, for the worker's start-up log: "--pooling", "modules.json", ...
    hidden_size: int = 0  # the pooled vector's length (config.json's hidden_size; 0: not known)
    kind: Literal["embed", "classify"] = "embed"
    activation: Activation = "identity"  # classify: on the logit, giving the score
    # A decoder reranker's (sentence-transformers' LogitScore): the logit is its last token's LM-head logit of
    # the true token, less the false token's where there is one; its pair is rendered by the chat template
    # as a "query" and a "document" message (sentence-transformers 6's pair roles).
    logit_tokens: tuple[int, ...] = ()
    chat: ChatInput | None = None  # an embedder's texts go through the chat template (the tokenizer renders)

    def score(self, logit: float) -> float:
        """A cross-encoder's score of its logit."""
        return 1.0 / (1.0 + math.exp(-logit)) if self.activation == "sigmoid" else logit

    def check_dimensions(self, dimensions: int | None) -> None:
        """A Refusal naming `dimensions` when the model was not trained to be cut there."""
        if dimensions is None:
            return
        hidden_size = self.hidden_size
        if dimensions < 1 or (hidden_size and dimensions > hidden_size):
            raise Refusal(
                f"dimensions must be between 1 and the model's embedding size {hidden_size}, got {dimensions}",
                "dimensions",
            )
        if self.matryoshka is False:
            raise Refusal(
                "this model does not support matryoshka representations: its vectors cannot be cut to "
                "`dimensions` (config.json has neither matryoshka_dimensions nor is_matryoshka)",
                "dimensions",
            )
        if isinstance(self.matryoshka, tuple) and dimensions not in self.matryoshka:
            raise Refusal(
                f"dimensions {dimensions} is not one this model was trained for: "
                f"{', '.join(map(str, self.matryoshka))}",
                "dimensions",
            )


def runner_for(runner: str, model_dir: Path, architecture: str) -> str:
    """ "generate" or "pooling": `runner` unless "auto" (see the module's rule)."""
    if runner != "auto":
        return runner
    if (model_dir / "modules.json").is_file() or architecture in HEADLESS_ARCHITECTURES:  # cross-encoders too
        return "pooling"
    return "generate"


def read_pooler(model_dir: Path, raw_config: dict[str, Any], override: str = "") -> PoolerConfig:
    """The pooling rule of the model in `model_dir` (config.json `raw_config`), `override` (a PoolingType)
    first; ModelLoadError for sentence-transformers modules this server does not run."""
    if (raw_config.get("architectures") or [""])[0] in CROSS_ENCODER_ARCHITECTURES:
        return _cross_encoder(model_dir, raw_config, override)
    matryoshka, hidden = _matryoshka(raw_config), int(raw_config.get("hidden_size") or 0)
    modules = _st_modules(model_dir)
    if "LogitScore" in modules:
        return _decoder_reranker(model_dir, modules["LogitScore"], override)
    normalize = "Normalize" in modules if modules else True
    if override:
        if override not in POOLING_TYPES:
            raise ModelLoadError(f"--pooling {override!r}: one of {', '.join(POOLING_TYPES)} expected")
        return PoolerConfig(
            pooling=cast(PoolingType, override),  # one of POOLING_TYPES, as checked
            normalize=normalize,
            matryoshka=matryoshka,
            source="--pooling",
            hidden_size=hidden,
            chat=read_chat_input(model_dir),
        )
    if not modules:
        encoder = (raw_config.get("architectures") or [""])[0] in ENCODER_ARCHITECTURES
        return PoolerConfig(
            pooling="cls" if encoder else "last", normalize=True, matryoshka=matryoshka, hidden_size=hidden
        )
    pooling = _st_pooling(model_dir / modules.get("Pooling", "1_Pooling"))
    return PoolerConfig(
        pooling=pooling,
        normalize=normalize,
        matryoshka=matryoshka,
        source="modules.json",
        hidden_size=hidden,
        chat=read_chat_input(model_dir),
    )


def _cross_encoder(model_dir: Path, raw: dict[str, Any], override: str) -> PoolerConfig:
    """A cross-encoder's head: its [CLS] classified into one logit, the activation sentence-transformers
    saved (`_st_activation`)."""
    where = model_dir / "config.json"
    labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 2))
    if labels != 1:
        raise ModelLoadError(f"{where}: a cross-encoder scores with one label, this one has {labels}")
    if override:
        raise ModelLoadError(f"--pooling {override}: a cross-encoder's head reads its [CLS] token, as trained")
    if read_chat_input(model_dir) is not None:
        raise ModelLoadError(
            f"{model_dir / 'sentence_bert_config.json'}: modality_config lists 'message' (sentence-transformers "
            "renders each pair through the chat template), which this server does not run for a cross-encoder"
        )
    return PoolerConfig(
        pooling="cls",
        normalize=False,
        kind="classify",
        activation=_st_activation(model_dir, raw),
        source="cross-encoder",
        hidden_size=int(raw.get("hidden_size") or 0),
    )


def _decoder_reranker(model_dir: Path, folder: str, override: str) -> PoolerConfig:
    """A decoder reranker (sentence-transformers' LogitScore module): the last token's logit of its true
    token (less its false token's), through the saved activation (sigmoid: the softmax of yes over no)."""
    if override:
        raise ModelLoadError(f"--pooling {override}: a decoder reranker reads its last token's logits, as trained")
    path = model_dir / folder / "config.json"
    try:
        config = json.loads(path.read_text())
        tokens = (int(config["true_token_id"]),) + (
            () if config.get("false_token_id") is None else (int(config["false_token_id"]),)
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: the LogitScore module's token ids cannot be read ({exc})") from None
    return PoolerConfig(
        pooling="last",
        normalize=False,
        kind="classify",
        activation=_st_activation(model_dir, {}),
        logit_tokens=tokens,
        source="modules.json",
    )


def _st_activation(model_dir: Path, raw: dict[str, Any]) -> Activation:
    """A cross-encoder's activation as sentence-transformers saved it (config_sentence_transformers.json, or
    config.json's `sentence_transformers`), else its default for one label, sigmoid."""
    st_config = model_dir / "config_sentence_transformers.json"
    saved = json.loads(st_config.read_text()) if st_config.is_file() else raw.get("sentence_transformers") or {}
    name = saved.get("activation_fn") or "torch.nn.modules.activation.Sigmoid"
    if name not in ACTIVATIONS:
        raise ModelLoadError(
            f"{model_dir}: activation_fn {name!r} is not run by this server ({', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


def _st_modules(model_dir: Path) -> dict[str, str]:
    """sentence-transformers' modules of the folder, by class name -> their folder (empty without modules.json);
    ModelLoadError naming one this server does not run."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
        modules = {str(entry["type"]).rsplit(".", 1)[-1]: str(entry.get("path", "")) for entry in entries}
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{path}: not a sentence-transformers module list ({exc})") from None
    unknown = sorted(set(modules) - {"Transformer", "Pooling", "Normalize", "LogitScore"})
    if unknown:
        raise ModelLoadError(
            f"{path}: sentence-transformers module(s) {', '.join(unknown)} are not run by this "
            f"server (it runs Transformer, Pooling, Normalize and LogitScore)"
        )
    if "Pooling" not in modules and "LogitScore" not in modules:
        raise ModelLoadError(f"{path} has no Pooling module: say how to pool with --pooling")
    return modules


def _st_pooling(folder: Path) -> PoolingType:
    """The pooling mode of a sentence-transformers Pooling module's `config.json`."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: the Pooling module's config cannot be read ({exc})") from None
    if config.get("include_prompt") is False:
        raise ModelLoadError(
            f"{path}: include_prompt false (an instruction left out of the mean) is not run by this server"
        )
    if isinstance(config.get("pooling_mode"), str):
        name = config["pooling_mode"]
        if name not in _ST_MODE_NAMES:
            raise ModelLoadError(
                f"{path}: pooling_mode {name!r} is not run by this server (it runs {', '.join(_ST_MODE_NAMES)})"
            )
        return _ST_MODE_NAMES[name]
    chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    other = [key for key in _ST_UNSUPPORTED_MODES if config.get(key)]
    if other or len(chosen) != 1:
        raise ModelLoadError(
            f"{path}: exactly one of {', '.join(_ST_MODES)} expected "
            f"(got {', '.join(other + [k for k in _ST_MODES if config.get(k)]) or 'none'})"
        )
    return chosen[0]


def read_chat_input(model_dir: Path) -> ChatInput | None:
    """How a sentence-transformers folder (it has `modules.json`) embeds a text when its Transformer module
    lists the `message` modality (sentence-transformers then turns every text into a message), else None;
    ModelLoadError for what it cannot be embedded with."""
    path = model_dir / "sentence_bert_config.json"  # sentence-transformers 6 saves the Transformer at the root
    if not (model_dir / "modules.json").is_file() or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        message = (config.get("modality_config") or {}).get("message")
        kwargs = dict((config.get("processing_kwargs") or {}).get("chat_template") or {})
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ModelLoadError(f"{path}: not a sentence-transformers Transformer config ({exc})") from None
    if not isinstance(message, dict):
        return None  # text only: saved before modality_config, or by a tokenizer without a chat template
    template = read_chat_template(model_dir)
    if template is None:
        raise ModelLoadError(f"{path}: modality_config lists 'message', but the tokenizer has no chat template")
    cut = [key for key in _ST_CUT_KWARGS if key in kwargs]
    if cut:
        raise ModelLoadError(
            f"{path}: processing_kwargs.chat_template sets {', '.join(cut)}, which this server does not run"
        )
    structured = _st_structured(model_dir, str(message.get("format", "auto")), template)
    return ChatInput(
        structured=structured, template_kwargs={k: v for k, v in kwargs.items() if k not in _ST_SIZE_KWARGS}
    )


def _st_structured(model_dir: Path, message_format: str, template: str) -> bool:
    """Whether sentence-transformers gives the message's content structured: as saved, else ("auto") as it
    infers it from the model type and the template's text."""
    if message_format in ("structured", "flat"):
        return message_format == "structured"
    if message_format != "auto":
        raise ModelLoadError(f"{model_dir}: message format {message_format!r} is not structured, flat or auto")
    config = model_dir / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type in _ST_FLAT_MODEL_TYPES:
        return False
    return any(pattern in template for pattern in _ST_STRUCTURED_PATTERNS)


def _matryoshka(raw: dict[str, Any]) -> tuple[int, ...] | bool:
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(int(d) for d in dims)
    return bool(raw.get("is_matryoshka", False))


def pooler_for(
    model_dir: Path, architecture: str, raw_config: dict[str, Any], runner: str, override: str = ""
) -> PoolerConfig | None:
    """The pooling rule the worker serves the model with, None for the generate runner; ModelLoadError for
    a decoder without an LM head asked to generate, or a pooling override on the generate runner."""
    if runner_for(runner, model_dir, architecture) == "generate":
        if architecture in HEADLESS_ARCHITECTURES:
            raise ModelLoadError(
                f"{architecture} has no LM head, so it cannot generate: serve it with --runner pooling (/v1/embeddings)"
            )
        if override:
            raise ModelLoadError(f"--pooling {override} needs the pooling runner (--runner pooling)")
        return None
    return read_pooler(model_dir, raw_config, override)


def finish_vector(pooled: bytes, dimensions: int | None, normalize: bool) -> np.ndarray:
    """A pooled vector as the client gets it: cut to its first `dimensions` entries (Matryoshka), then
    normalised to unit length where the model's files say (vLLM's order)."""
    vector = np.frombuffer(pooled, dtype="<f4")
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # as torch's F.normalize (eps 1e-12)
    return vector.astype(np.float32)
