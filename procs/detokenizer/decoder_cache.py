"""The detokenizer's tokenizer: the Rust `tokenizers.Tokenizer` that transformers builds for the model,
kept in a cache so that later starts skip transformers.

Decoding needs only the backend tokenizer (its decoder and its added tokens with their special flags:
`incremental.make_decode`, `incremental.special_token_ids`), but building it goes through
`AutoTokenizer`, whose import pulls in torch: ~6 CPU-seconds and ~300 MB for a process that then only
decodes. transformers may change the backend it reads from tokenizer.json (a class's own decoder, the
special flags of tokenizer_config.json), so the cache holds what transformers built, serialized, not the
file: exact by construction. The key hashes every non-weight file of the folder and transformers'
version, so an edited tokenizer or an upgrade builds it again. A tokenizer without a Rust backend (a slow
one) is used as transformers gives it, uncached.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path

import tokenizers

from batchserve.shared.config import cache_dir
from batchserve.shared.model import load_tokenizer

log = logging.getLogger("batchserve.detokenizer")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".npz")


def tokenizer_key(model_dir: Path) -> str:
    """A digest of the folder's non-weight files (names and bytes) and of transformers' version."""
    digest = hashlib.sha256(importlib.metadata.version("transformers").encode())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


def load_decoding_tokenizer(model_dir: Path) -> object:
    """The tokenizer the detokenizer decodes with: the cached backend when there is one, else transformers'
    tokenizer (its backend then cached for the next start)."""
    path = cache_dir() / "tokenizers" / f"{tokenizer_key(model_dir)}.json"
    if path.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # a damaged cache file (tokenizers raises plain Exception): built again, replaced
            log.warning("ignoring the cached tokenizer %s: %s", path, exc)
    tokenizer = load_tokenizer(model_dir)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        _write_atomically(path, backend.to_str())
    return tokenizer


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the whole file or none (another process may start at
    once); a cache that cannot be written only costs the next start its speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            out.write(text)
        os.replace(out.name, path)
    except OSError as exc:
        log.info("could not cache the tokenizer at %s: %s", path, exc)
