"""The model's tokenizer as transformers builds it, kept in a cache so that later starts skip building it.

`AutoTokenizer` imports torch (through transformers' config classes): ~6 CPU-seconds and ~300 MB in
the tokenizer and detokenizer processes, which never use torch, and most of a small model's start. So
the cache holds what transformers built, not the files it read (transformers may change what it reads:
a class's own decoder, the special flags of tokenizer_config.json), exact by construction:
- `load_cached_tokenizer`: the whole tokenizer, pickled; unpickling imports its class's module, not
  torch (~1.5 s). The cache lives beside the compiled C kernels and converted models, in the user's own
  cache folder, and is trusted as they are.
- `load_decoding_tokenizer`: the Rust `tokenizers.Tokenizer` alone, serialized, for a process that only
  decodes (the detokenizer: `incremental.make_decode` and `special_token_ids` read nothing else).
The key hashes every non-weight file of the folder and the versions of transformers, tokenizers and
Python, so an edited tokenizer or an upgrade builds it again; a damaged cache file is built again and
replaced; a cache that cannot be written only costs the next start its speed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from batchserve.shared.config import cache_dir
from batchserve.shared.errors import ModelLoadError

log = logging.getLogger("batchserve.tokenizer_cache")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".npz", ".h5", ".msgpack", ".onnx", ".ckpt")


def tokenizer_key(model_dir: Path) -> str:
    """A digest of the folder's non-weight files (names and bytes), and of the versions that build and read
    the cache: transformers', tokenizers' and Python's."""
    versions = [importlib.metadata.version(name) for name in ("transformers", "tokenizers")] + [sys.version]
    digest = hashlib.sha256("\0".join(versions).encode())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


def build_tokenizer(model_dir: Path) -> Any:
    """The tokenizer as transformers builds it (`AutoTokenizer`), uncached."""
    from transformers import AutoTokenizer

    if not ((model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()):
        raise ModelLoadError(f"model folder {model_dir} has no tokenizer files")
    return AutoTokenizer.from_pretrained(model_dir)


def _cached(model_dir: Path, suffix: str) -> Path:
    return cache_dir() / "tokenizers" / f"{tokenizer_key(model_dir)}{suffix}"


def load_cached_tokenizer(model_dir: Path) -> Any:
    """The Hugging Face tokenizer (with its chat template), from the cache when it is there."""
    path = _cached(model_dir, ".pickle")
    cached = _read(path, lambda: pickle.loads(path.read_bytes()))
    if cached is not None:
        return cached
    tokenizer = build_tokenizer(model_dir)
    try:
        _write_atomically(path, pickle.dumps(tokenizer))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a tokenizer class that does not pickle
        log.info("the tokenizer of %s is not cached: %s", model_dir, exc)
    return tokenizer


def load_decoding_tokenizer(model_dir: Path) -> object:
    """The tokenizer a process that only decodes needs: the cached backend when there is one, else
    transformers' tokenizer (its backend then cached for the next start; a slow tokenizer, without a Rust
    backend, is used as it is)."""
    path = _cached(model_dir, ".json")
    cached = _read(path, lambda: tokenizers.Tokenizer.from_file(str(path)))
    if cached is not None:
        return cached
    tokenizer = build_tokenizer(model_dir)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        _write_atomically(path, backend.to_str().encode())
    return tokenizer


def _read(path: Path, read: Callable[[], Any]) -> Any:
    """What `read` makes of the cached file at `path`; None when there is none or it is damaged (unpickling
    and tokenizers raise whatever its bytes lead to, plain Exception included): built again, replaced."""
    if not path.is_file():
        return None
    try:
        return read()
    except Exception as exc:
        log.warning("ignoring the cached tokenizer %s: %s", path, exc)
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the whole file or none (another process may start at
    once); a failed write leaves no temporary file behind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, suffix=".tmp", delete=False) as out:
            tmp = out.name
            out.write(data)
        os.chmod(tmp, 0o644)  # readable by a service account, as the C kernels' library is
        os.replace(tmp, path)
    except OSError as exc:
        log.info("could not cache the tokenizer at %s: %s", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
