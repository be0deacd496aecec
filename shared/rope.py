"""A model's rotary position embedding as its config.json describes it (`RopeConfig.from_hf`): one reading
for the worker, which builds the cos/sin tables from it (`kernels.rope`), and for the scheduler, which
keys the prefix cache by the rope regime of a request (`switch_length`).

The fields and their defaults are transformers' (`modeling_rope_utils`, `standardize_rope_params`):
transformers 5 writes `rope_parameters` (theta inside), older configs `rope_theta` + `rope_scaling`; a
top-level `original_max_position_embeddings` (Phi-3's) wins over the one in the parameters, and either
falls back to `max_position_embeddings`; `partial_rotary_factor` may stand at the top level too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate (the first ones)
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn, longrope: cos and sin scaled by it (None: from factor)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: the correction range rounded outwards to whole dims
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str, layer_type: str = "full_attention") -> RopeConfig:
        """The rope of config.json `raw` (of `layer_type`'s layers where the parameters are per layer type,
        transformers 5's Gemma 3); ValueError naming `where` for a type or field we cannot run."""
        params = dict(raw.get("rope_parameters") or {})
        if isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        else:
            params.update(raw.get("rope_scaling") or {})
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {kind!r} in {where} (supported: {', '.join(ROPE_TYPES)})")
        positions = int(raw.get("max_position_embeddings") or 8192)
        original = int(
            raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or positions
        )
        fields: dict[str, Any] = dict(
            theta=float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0),
            kind=kind,
            partial_rotary_factor=float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0),
            original_max_position_embeddings=original,
            max_position_embeddings=positions,
        )
        try:
            if kind in ("linear", "llama3", "yarn", "dynamic"):
                fields["factor"] = float(params["factor"] or positions / original)
            if kind == "llama3":
                fields.update(
                    low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"])
                )
            if kind == "yarn":
                fields.update(
                    beta_fast=float(params.get("beta_fast") or 32),
                    beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)),
                    mscale=params.get("mscale"),
                    mscale_all_dim=params.get("mscale_all_dim"),
                )
            if kind == "longrope":
                fields.update(
                    factor=float(params.get("factor") or positions / original),
                    short_factor=tuple(map(float, params["short_factor"])),
                    long_factor=tuple(map(float, params["long_factor"])),
                )
            if kind in ("yarn", "longrope") and params.get("attention_factor") is not None:
                fields["attention_factor"] = float(params["attention_factor"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"rope scaling {kind!r} in {where}: missing or malformed field {e}") from None
        return cls(**fields)

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dims rotate."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def dynamic_length(self) -> int:
        """Dynamic NTK: the length past which the frequencies follow a sequence's length (the model's
        `max_position_embeddings`); 0: they do not."""
        return self.max_position_embeddings if self.kind == "dynamic" else 0

    @property
    def served_positions(self) -> int:
        """The positions the model serves: its own, or with dynamic NTK `factor` times them (as vLLM's)."""
        return (
            int(self.max_position_embeddings * self.factor) if self.kind == "dynamic" else self.max_position_embeddings
        )

    @property
    def switch_length(self) -> int:
        """The length past which the factors switch (longrope: short factors up to the original context,
        long ones beyond); 0: one set of factors at every length."""
        return self.original_max_position_embeddings if self.kind == "longrope" else 0
