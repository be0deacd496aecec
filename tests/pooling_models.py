"""Tiny embedding models the pooling tests build: a random-weight decoder saved as a sentence-transformers
folder (modules.json, the Pooling module's config, Normalize or not), and its reference vectors from
`SentenceTransformer.encode`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from conftest import build_tiny_model

ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def build_st_embedder(
    out_dir: Path,
    arch: str = "qwen3",
    *,
    pooling: str = "last",
    normalize: bool = True,
    headless: bool = False,
    **config: Any,
) -> Path:
    """A random `arch` decoder (`build_tiny_model`, its words `w3..`) as a sentence-transformers embedder;
    `headless`: saved without its LM head as transformers' `Qwen3Model` names it (no `model.` prefix), as
    Qwen3-Embedding's checkpoint is. Its tokenizer pads on the left and has no chat template (a text is
    embedded as it is tokenized, which sentence-transformers 6 does only without one)."""
    import transformers

    build_tiny_model(out_dir, arch, with_tokenizer=True, **config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    tokenizer.chat_template, tokenizer.pad_token, tokenizer.padding_side = None, "<unk>", "left"
    tokenizer.save_pretrained(out_dir)
    if headless:
        model = transformers.AutoModel.from_pretrained(out_dir)  # the decoder alone
        for file in out_dir.glob("*.safetensors"):
            file.unlink()
        model.save_pretrained(out_dir)
    return write_st_files(out_dir, pooling, normalize)


def write_st_files(out_dir: Path, pooling: str, normalize: bool) -> Path:
    """sentence-transformers' files beside a model: modules.json, the Pooling module's config, Normalize or not."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((out_dir / "config.json").read_text())["hidden_size"]
    (out_dir / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": hidden,
                **{key: mode == pooling for mode, key in ST_MODES.items()},
                "pooling_mode_max_tokens": False,
                "include_prompt": True,
            }
        )
    )
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return out_dir


def write_wordpiece_tokenizer(out_dir: Path, vocab_size: int, token_types: bool = True) -> None:
    """A BERT-style tokenizer over the words w5..: [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4, inputs as
    [CLS] a [SEP] and pairs as [CLS] a [SEP] b [SEP] (with `token_types`, types 0 then 1, as BERT's
    tokenizers give them; without, none, as a RoBERTa's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, **{f"w{i}": i for i in range(5, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=names,
    ).save_pretrained(out_dir)


def build_encoder(out_dir: Path, arch: str = "bert", *, head: str = "", seed: int = 0, **config: Any) -> Path:
    """A random-weight BERT-style encoder (`BertModel`, `XLMRobertaModel`; with `head` "classification" their
    ForSequenceClassification) with its biases and norms drawn away from 0 and 1, and a tokenizer."""
    import torch
    import transformers

    name = {"bert": "Bert", "xlm_roberta": "XLMRoberta"}[arch]
    positions = 128 + (2 if arch == "xlm_roberta" else 0)  # a RoBERTa's first position is padding_idx + 1
    fields = {
        **dict(
            vocab_size=320,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=positions,
            initializer_range=0.2,
            pad_token_id=0 if arch == "bert" else 1,
        ),
        **config,
    }
    torch.manual_seed(seed)
    cls = getattr(transformers, name + ("ForSequenceClassification" if head else "Model"))
    model = cls(getattr(transformers, name + "Config")(**fields)).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "LayerNorm.weight" in param_name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(out_dir)
    write_wordpiece_tokenizer(out_dir, fields["vocab_size"], token_types=arch == "bert")
    return out_dir


def st_vectors(model_dir: Path, texts: list[str], **encode: Any) -> np.ndarray:
    """sentence-transformers' vectors of `texts` (its own batches, padded)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, **encode)


def words(n: int, first: int) -> str:
    """n of the tiny vocabulary's words, from w{first} on (wrapping below its 320)."""
    return " ".join(f"w{3 + (first + i) % 300}" for i in range(n))


def build_decoder_reranker(out_dir: Path) -> Path:
    """A random Qwen3 decoder as sentence-transformers 6 saves a reranker: a CrossEncoder of a
    text-generation Transformer and a LogitScore of two tokens' logits (the first pieces of "yes" and "no"
    in the tiny byte-level vocabulary), whose chat template
    renders a pair's "query" and "document" messages into a judging prompt (as Qwen3-Reranker's does)."""
    import transformers
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    base = out_dir.parent / f"{out_dir.name}-base"
    build_tiny_model(base, "qwen3", with_tokenizer="bytes")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = (
        "<s>system\nJudge whether the Document meets the requirements based on the Query. Answer yes or no.</s>\n"
        "<s>user\n<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
        "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}"
        "</s>\n<s>assistant\n"
    )
    tokenizer.pad_token, tokenizer.padding_side = "<unk>", "left"
    tokenizer.save_pretrained(base)
    ids = [tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no")]
    assert ids[0] != ids[1]
    modules = [
        Transformer(str(base), transformer_task="text-generation"),
        LogitScore(true_token_id=ids[0], false_token_id=ids[1]),
    ]
    CrossEncoder(modules=modules, device="cpu").save(str(out_dir))
    return out_dir


def build_message_embedder(
    out_dir: Path,
    template: str,
    *,
    pooling: str = "mean",
    chat_kwargs: dict[str, Any] | None = None,
    decoder: bool = False,
) -> Path:
    """A random BERT encoder (`build_encoder`; `decoder`: a Qwen3, its words `w3..`, padded on the left) whose
    tokenizer has the chat `template`, saved by sentence-transformers 6 itself: its Transformer module then
    lists the `message` modality (and the message format it infers from the template) in
    sentence_bert_config.json, so `encode` renders each text as a user message through the template;
    `chat_kwargs`: its saved `processing_kwargs["chat_template"]`."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    base = out_dir.parent / f"{out_dir.name}-base"
    if decoder:
        build_tiny_model(base, "qwen3", with_tokenizer=True)
    else:
        build_encoder(base)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = template
    if decoder:
        tokenizer.pad_token, tokenizer.padding_side = "<unk>", "left"
    tokenizer.save_pretrained(base)
    processing = {"chat_template": chat_kwargs} if chat_kwargs else None
    transformer = Transformer(str(base), processing_kwargs=processing)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out_dir))
    return out_dir
