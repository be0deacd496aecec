"""Multi-LoRA in the worker: PEFT adapters beside the base weights, rows of different adapters (and of the
base model) in one step.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) whose LoRA pairs target
any of the decoder's seven projections (q, k, v, o, gate, up, down). Each wrapped projection adds, for
the rows of each adapter in the step, x . A^T . B^T . scale (scale = lora_alpha / r, or / sqrt(r) with
rsLoRA, folded into B at load), one matmul pair per adapter segment (S-LoRA's and Punica's segmented
form); base rows add nothing. What PEFT would run otherwise, or differently, is refused at load in one
line naming the field (`AdapterConfig.read`).

`LoraSlots` holds the loaded adapters by index, each request slot's adapter (`SlotStart.adapter`), and the
step's rows per adapter (`plan`, before the forward pass); the model's projections read them through
`LoraTarget`s that `attach` hangs on them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from shared.model import ModelLoadError

# PEFT's module names -> (the fused projection of our layer that holds it, its part in the fusion)
PROJECTIONS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
               "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
PREFIX = "base_model.model.model.layers."


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    targets: frozenset[str]  # of PROJECTIONS

    @classmethod
    def read(cls, folder: Path, max_rank: int) -> AdapterConfig:
        """`adapter_config.json` of `folder`; ModelLoadError naming what this server does not run."""
        path = folder / "adapter_config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"LoRA adapter {folder}: cannot read adapter_config.json ({exc})") from None
        refuse = lambda field, why: ModelLoadError(f"LoRA adapter {path}: {field} {why}")
        if raw.get("peft_type", "LORA") != "LORA":
            raise refuse("peft_type", f"{raw['peft_type']!r} is not served (LORA is)")
        for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters", "layers_to_transform",
                      "layer_replication"):
            if raw.get(field):
                raise refuse(field, f"{raw[field]!r} is not served (adapters of the seven projections only)")
        if raw.get("use_dora"):
            raise refuse("use_dora", "true (DoRA) is not served")
        if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
            raise refuse("bias", f"{raw.get('bias')!r} is not served (none is)")
        targets = raw.get("target_modules") or []
        if isinstance(targets, str) or set(targets) - set(PROJECTIONS):
            raise refuse("target_modules", f"{targets!r}: only {', '.join(PROJECTIONS)} are served "
                                           f"(not lm_head, embeddings or a regular expression)")
        rank = int(raw["r"])
        if not 1 <= rank <= max_rank:
            raise refuse("r", f"{rank} is above --max-lora-rank {max_rank}")
        alpha = float(raw.get("lora_alpha", rank))
        return cls(rank, alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank), frozenset(targets))


@dataclass
class LoraAdapter:
    name: str
    config: AdapterConfig
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, PEFT module) -> (A [r, in], B*scale)

    @classmethod
    def load(cls, name: str, folder: str | Path, max_rank: int, num_layers: int, dtype: torch.dtype,
             device: torch.device) -> LoraAdapter:
        folder = Path(folder)
        config = AdapterConfig.read(folder, max_rank)
        try:
            tensors = load_file(folder / "adapter_model.safetensors")
        except OSError as exc:
            raise ModelLoadError(f"LoRA adapter {folder}: cannot read adapter_model.safetensors ({exc})") from None
        pairs = {}
        for layer in range(num_layers):
            for module in config.targets:
                group = "self_attn" if PROJECTIONS[module][0] in ("qkv", "o") else "mlp"
                name_of = lambda part: f"{PREFIX}{layer}.{group}.{module}.lora_{part}.weight"
                if name_of("A") not in tensors:
                    continue  # a target module absent from a layer: nothing added there
                a, b = tensors.pop(name_of("A")), tensors.pop(name_of("B"))
                pairs[(layer, module)] = (a.to(device=device, dtype=dtype).contiguous(),
                                          (b.float() * config.scale).to(device=device, dtype=dtype).contiguous())
        if tensors:
            raise ModelLoadError(f"LoRA adapter {folder}: tensors of no served projection: {', '.join(sorted(tensors)[:3])}")
        return cls(name, config, pairs)


class LoraSlots:
    """The loaded adapters (index 0: none, the base model), each slot's, and the step's rows per adapter."""

    def __init__(self, max_running_requests: int, device: torch.device) -> None:
        self.adapters: dict[int, LoraAdapter] = {}
        self.slot_adapter = np.zeros(max_running_requests, dtype=np.int64)
        self.device = device
        self.rows: list[tuple[LoraAdapter, torch.Tensor | None]] = []  # this step's (adapter, packed rows; None: all)

    def add(self, index: int, adapter: LoraAdapter) -> None:
        self.adapters[index] = adapter

    def start(self, slot: int, adapter: int) -> None:
        if adapter and adapter not in self.adapters:
            raise ValueError(f"slot {slot}: no LoRA adapter {adapter} loaded")
        self.slot_adapter[slot] = adapter

    def plan(self, slots: list[int], extend_lens: list[int], num_padding: int = 0) -> None:
        """The step's rows of each adapter its requests use (padded rows: the base model's)."""
        per_token = np.repeat(self.slot_adapter[np.asarray(slots, dtype=np.int64)], extend_lens)
        if num_padding:
            per_token[len(per_token) - num_padding:] = 0
        self.rows = []
        for index in np.unique(per_token).tolist():
            if index:
                rows = None if (per_token == index).all() else \
                    torch.from_numpy(np.flatnonzero(per_token == index)).to(self.device)
                self.rows.append((self.adapters[index], rows))

    @property
    def active(self) -> bool:
        return bool(self.rows)


@dataclass
class LoraTarget:
    """The LoRA pairs one fused projection of one layer adds: its parts (PEFT module, output columns)."""

    slots: LoraSlots
    layer: int
    parts: list[tuple[str, slice]]

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for adapter, rows in self.slots.rows:
            xs = x if rows is None else x[rows]
            for module, columns in self.parts:
                pair = adapter.pairs.get((self.layer, module))
                if pair is None:
                    continue
                delta = (xs @ pair[0].T) @ pair[1].T
                if rows is None:
                    out[:, columns] += delta
                else:
                    out[rows, columns] += delta
        return out


def attach(layers: list[Any], slots: LoraSlots, q_size: int, kv_size: int, intermediate: int) -> None:
    """Hang `LoraTarget`s on every layer's q|k|v, o, gate|up and down projections (the parts' output columns)."""
    for index, layer in enumerate(layers):
        whole = lambda size: slice(0, size)
        layer.qkv.lora = LoraTarget(slots, index, [("q_proj", whole(q_size)), ("k_proj", slice(q_size, q_size + kv_size)),
                                                   ("v_proj", slice(q_size + kv_size, q_size + 2 * kv_size))])
        layer.o.lora = LoraTarget(slots, index, [("o_proj", slice(None))])
        mlp = layer.mlp
        mlp.gate_up.lora = LoraTarget(slots, index, [("gate_proj", whole(intermediate)),
                                                     ("up_proj", slice(intermediate, 2 * intermediate))])
        mlp.down.lora = LoraTarget(slots, index, [("down_proj", slice(None))])
