"""Multi-LoRA in the worker: PEFT adapters beside the base weights, rows of different adapters (and of the
base model) in one step.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) whose LoRA pairs target
any of the decoder's seven projections (q, k, v, o, gate, up, down). Each wrapped projection adds, for
the rows of each adapter in the step, x . A^T . B^T . scale (scale = lora_alpha / r, or / sqrt(r) with
rsLoRA, folded into B at load), as two matmuls per projection over every adapter's stacked pairs, each
row masked to its own adapter's (`LoraSlots`); base rows add nothing. What PEFT would run otherwise, or differently, is refused at load in one
line naming the field (`AdapterConfig.read`).

`LoraSlots` holds the loaded adapters by index (their pairs stacked per projection), each request slot's
adapter (`SlotStart.adapter`), and the step's mask of each row's adapter (`plan`, before the forward
pass); the model's projections read them through `LoraTarget`s that `attach` hangs on them.
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

from kernels.ops import linear, pack_linear_weight
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
    """The loaded adapters (index 0: none, the base model), each slot's, and the step's rows per adapter.

    The adapters' pairs of one projection are stacked (A [sum of ranks, in], B [out, sum of ranks], each
    adapter its own run of columns, zeros where it does not target the projection), so a step adds them with
    two matmuls per projection whatever its adapters: x . A^T, masked to each row's own adapter's columns
    (`plan`), then . B^T (the segmented form as dense matmuls: no gather, no per-adapter loop)."""

    def __init__(self, max_running_requests: int, device: torch.device) -> None:
        self.adapters: dict[int, LoraAdapter] = {}
        self.slot_adapter = np.zeros(max_running_requests, dtype=np.int64)
        self.device = device
        self.columns: dict[int, tuple[int, int]] = {}  # adapter -> (first stacked column, rank)
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, module) -> (A, B)
        self.mask: torch.Tensor | None = None  # [tokens, sum of ranks]: 1 on each row's adapter's columns
        self.dtype = torch.float32

    def add(self, index: int, adapter: LoraAdapter) -> None:
        self.adapters[index] = adapter
        self.dtype = next(iter(adapter.pairs.values()))[0].dtype if adapter.pairs else self.dtype
        self._stack()

    def start(self, slot: int, adapter: int) -> None:
        if adapter and adapter not in self.adapters:
            raise ValueError(f"slot {slot}: no LoRA adapter {adapter} loaded")
        self.slot_adapter[slot] = adapter

    def plan(self, slots: list[int], extend_lens: list[int], num_padding: int = 0) -> None:
        """The step's mask of each row's adapter columns (None: no row has an adapter)."""
        per_token = np.repeat(self.slot_adapter[np.asarray(slots, dtype=np.int64)], extend_lens)
        if num_padding:
            per_token[len(per_token) - num_padding:] = 0
        if not per_token.any():
            self.mask = None
            return
        total = sum(rank for _, rank in self.columns.values())
        mask = np.zeros((len(per_token), total), dtype=np.float32)
        for index in np.unique(per_token[per_token > 0]).tolist():
            first, rank = self.columns[index]
            mask[per_token == index, first:first + rank] = 1.0
        self.mask = torch.from_numpy(mask).to(device=self.device, dtype=self.dtype)

    @property
    def active(self) -> bool:
        return self.mask is not None

    def _stack(self) -> None:
        first, self.columns = 0, {}
        for index in sorted(self.adapters):
            self.columns[index] = (first, self.adapters[index].config.rank)
            first += self.adapters[index].config.rank
        keys = {key for adapter in self.adapters.values() for key in adapter.pairs}
        self.stacks = {}
        for key in keys:
            a_parts, b_parts = [], []
            some = next(a.pairs[key] for a in self.adapters.values() if key in a.pairs)
            for index in sorted(self.adapters):
                rank = self.columns[index][1]
                pair = self.adapters[index].pairs.get(key)
                a_parts.append(pair[0] if pair else some[0].new_zeros((rank, some[0].shape[1])))
                b_parts.append(pair[1] if pair else some[1].new_zeros((some[1].shape[0], rank)))
            # packed as the base weights are: on the CPU the same C kernels (MKL's threads beside theirs
            # would wait out each other's spinning: a LoRA step 20x slower in one measurement)
            self.stacks[key] = (pack_linear_weight(torch.cat(a_parts), "none"),
                                pack_linear_weight(torch.cat(b_parts, dim=1), "none"))


@dataclass
class LoraTarget:
    """The LoRA pairs one fused projection of one layer adds: its parts (PEFT module, output columns)."""

    slots: LoraSlots
    layer: int
    parts: list[tuple[str, slice]]

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mask = self.slots.mask
        for module, columns in self.parts:
            stack = self.slots.stacks.get((self.layer, module))
            if stack is not None:
                out[:, columns] += linear(linear(x, stack[0]) * mask, stack[1])
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
