"""Weight loading for the worker: `ModelConfig` (config.json's fields the model code needs) and
`iter_safetensors`. Finding the model (aliases, GGUF conversion) is `shared.model`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from shared.model import SUPPORTED_ARCHITECTURES, ModelLoadError, eos_token_ids, model_positions, read_model_json

__all__ = ["ModelConfig", "ModelLoadError", "RopeConfig", "iter_safetensors", "load_model_config"]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The fields of config.json the model needs, normalised across Llama / Qwen2 / Qwen3."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False  # attention_bias on Llama / Qwen3 also biases o_proj (Qwen2: q, k, v only)
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()


def load_model_config(model_dir: Path) -> ModelConfig:
    config_path = Path(model_dir) / "config.json"
    raw = read_model_json(model_dir)
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else ""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {architecture or '(none)'} in {config_path}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r} in {config_path}")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=model_positions(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        o_bias=architecture != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=_rope_config(raw, config_path),
        eos_token_ids=eos_token_ids(Path(model_dir), raw),
    )


def _rope_config(raw: dict[str, Any], where: Path) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs write rope_theta + rope_scaling
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind=kind, factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta, kind=kind, factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"unsupported rope scaling type {kind!r} in {where} (supported: default, linear, llama3)")


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) for every tensor of every *.safetensors file in the folder."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
