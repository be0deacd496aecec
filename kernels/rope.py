"""Rotary position embeddings: each rope type's inverse frequencies and attention factor, as transformers
computes them (`modeling_rope_utils`), and `RotaryTables`, the cos/sin rows the models index per token.

A rope whose factors switch with the length (longrope) has two tables, short and long, stacked. Which
one a key has is transformers' rule for Phi-3: a sequence no longer than the original context has the
short factors; once it grows past it, every key has the long ones (Phi-3's `generate` drops its cache
there and recomputes the sequence; the scheduler recomputes such a request too,
`Scheduler.recompute_at_rope_switch`). `RotaryTables.rows` maps (position, the request's prompt length
as prefilled) to a table row, long when either passes the switch: a prompt longer than the original
context is long from its first chunk.

Dynamic NTK stretches the base with the sequence's length L past `max_position_embeddings` (it serves
`factor` times that). transformers recomputes the frequencies in each forward for its longest sequence
and keeps the keys already cached, so at batch 1 a key has the frequencies of the length its sequence had
when it was computed: a prompt's keys those of the whole prompt (one forward), each later token's those of
its position + 1. `rows` gives every token that length, L = max(prompt length, position + 1), whatever the
chunks: a later token's row is in a second table of (p, p + 1) rows; a long prompt's other tokens' cos and
sin are computed for the step (their frequencies follow the prompt's length) and `lookup` puts them in.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from batchserve.shared.rope import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (float32); `long`: longrope's long factors."""
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    base = 1.0 / (rope.theta**exponents)
    if rope.kind in ("default", "dynamic"):  # dynamic: the base frequencies up to the model's positions
        return base
    if rope.kind == "linear":
        return base / rope.factor
    if rope.kind == "llama3":
        return _llama3(rope, base)
    if rope.kind == "yarn":
        return _yarn(rope, dim)
    if rope.kind == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        if factors.shape != (dim // 2,):
            raise ValueError(
                f"longrope {'long' if long else 'short'}_factor has {factors.shape[0]} entries, "
                f"expected rotary_dim / 2 = {dim // 2}"
            )
        return 1.0 / (factors * rope.theta**exponents)
    raise ValueError(f"unsupported rope type {rope.kind!r}")


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are scaled by (yarn's and longrope's attention factor; 1 for the others)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.factor
    if rope.kind == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        return _yarn_mscale(factor)
    if rope.kind == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def _llama3(rope: RopeConfig, inv: torch.Tensor) -> torch.Tensor:
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv / rope.factor, inv)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / rope.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolated (÷ factor) frequencies for the long wavelengths, the original ones for the short,
    a linear ramp between the dims that make `beta_slow` and `beta_fast` turns in the original context."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(turns: float) -> float:
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def dynamic_inv_freq(rope: RopeConfig, head_dim: int, lengths: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK's inverse frequencies [len(lengths), rotary_dim / 2] (float32) for sequences of `lengths`
    (int64), in transformers' arithmetic: the base ones up to `max_position_embeddings`."""
    dim, original = rope.rotary_dim(head_dim), rope.max_position_embeddings
    lengths = torch.maximum(lengths, torch.tensor(original, dtype=lengths.dtype))
    base = rope.theta * ((rope.factor * lengths / original) - (rope.factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def cos_sin(inv: torch.Tensor, max_positions: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, 2 * len(inv)] (float32, rotate-half layout), times `scale`."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RotaryTables:
    """The cos/sin rows [rows, rotary_dim] a model indexes per token (`rows` says which)."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, *, device: torch.device, dtype: torch.dtype
    ):
        self.rope, self.head_dim = rope, head_dim
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.max_positions = max_positions
        self.switch_length = rope.switch_length
        self.dynamic_length = rope.dynamic_length
        scale = attention_factor(rope)
        tables = [cos_sin(inv_freq(rope, head_dim), max_positions, scale)]
        if self.switch_length:
            tables.append(cos_sin(inv_freq(rope, head_dim, long=True), max_positions, scale))
        if self.dynamic_length:  # rows (p, p + 1)
            positions = torch.arange(max_positions)
            freqs = positions[:, None].float() * dynamic_inv_freq(rope, head_dim, positions + 1)
            emb = torch.cat((freqs, freqs), dim=-1)
            tables.append((emb.cos(), emb.sin()))
        self.cos = torch.cat([cos for cos, _ in tables]).to(device=device, dtype=dtype)
        self.sin = torch.cat([sin for _, sin in tables]).to(device=device, dtype=dtype)
        self._step_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (tokens, cos, sin)

    def lookup(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, rotary_dim] of the step's `rows` (as `rows` made them), with the rows it
        computed for the step put in."""
        cos, sin = self.cos[rows], self.sin[rows]
        if self._step_rows is not None:
            tokens, step_cos, step_sin = self._step_rows
            cos[tokens], sin[tokens] = step_cos, step_sin
        return cos, sin

    @property
    def has_step_rows(self) -> bool:
        """Whether this step has rows computed for it (`lookup` puts them in; a captured graph would not)."""
        return self._step_rows is not None

    @property
    def follows_length(self) -> bool:
        """Whether a token's row depends on its request's prompt length as well as its position."""
        return bool(self.switch_length or self.dynamic_length)

    def rows(self, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """Each token's table row: its position, in the long table when its request's prompt or the
        position itself passes the switch (the module's rule); `prompt_lens`: its request's prompt length."""
        if self.dynamic_length:
            return self._dynamic_rows(positions, prompt_lens)
        if not self.switch_length:
            return positions
        long = np.maximum(positions + 1, prompt_lens) > self.switch_length
        return (positions + long * self.max_positions).astype(positions.dtype)

    def _dynamic_rows(self, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """Dynamic NTK (the module's rule): the position's own row up to the model's positions, its (p, p + 1)
        row when it ends its sequence, else (a long prompt's earlier tokens) cos and sin computed for the step."""
        lengths = np.maximum(positions + 1, prompt_lens)
        last = lengths == positions + 1
        rows = np.where(lengths > self.dynamic_length, positions + last * self.max_positions, positions)
        inside = np.flatnonzero((lengths > self.dynamic_length) & ~last)
        self._step_rows = None
        if inside.shape[0]:
            at = torch.from_numpy(positions[inside].astype(np.int64))
            freqs = at[:, None].float() * dynamic_inv_freq(
                self.rope, self.head_dim, torch.from_numpy(lengths[inside].astype(np.int64))
            )
            emb = torch.cat((freqs, freqs), dim=-1)
            self._step_rows = (
                torch.from_numpy(inside).to(self.cos.device),
                emb.cos().to(self.cos),
                emb.sin().to(self.sin),
            )
        return rows.astype(positions.dtype)
