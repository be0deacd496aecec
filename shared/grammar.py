"""The grammar engine's view of a model's tokenizer, built the same way by the tokenizer process (to
check grammars) and the worker (to mask logits): llguidance (https://github.com/guidance-ai/llguidance),
which compiles JSON schemas, regexes and Lark grammars and computes each step's allowed-token bitmask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import llguidance


def grammar_tokenizer(model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """`vocab_size` is the model's logits width (ids past the tokenizer's own are never allowed);
    a grammar that is complete allows only the EOS ids. Slow for a large vocabulary: build it once."""
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    eos = list(eos_token_ids) or None
    if tokenizer_json.is_file():
        return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos)
    from transformers import AutoTokenizer  # a slow-only folder: transformers converts it
    from llguidance.hf import from_tokenizer

    return from_tokenizer(AutoTokenizer.from_pretrained(model_dir), n_vocab=vocab_size, eos_token=eos)
