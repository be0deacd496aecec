"""Multi-LoRA in the worker: PEFT adapters beside the base weights, rows of different adapters (and of the
base model) in one step.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) whose LoRA pairs target
any of the decoder's seven projections (q, k, v, o, gate, up, down). Each wrapped projection adds, for the
rows of each adapter in the step, x . A^T . B^T . scale (scale = lora_alpha / r, or / sqrt(r) with rsLoRA,
folded into B at load), as two matmuls per projection over every adapter's stacked pairs, each row masked to
its own adapter's (`LoraSlots`); base rows add nothing. What PEFT would run otherwise, or differently, is
refused at load in one line naming the field (`AdapterConfig.read`).

`LoraSlots` holds the loaded adapters by index (their pairs stacked per projection), each request slot's
adapter (`SlotStart.adapter`), and the step's mask of each row's adapter (`plan`, before the forward
pass); the model's projections read them through `LoraTarget`s that `attach` hangs on them. Under tensor
parallelism each rank holds its share of every pair, cut as its projection is (`Shard`): a row-parallel
projection adds its LoRA term to the rank's partial output, so the ranks' one all-reduce sums it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from batchserve.kernels.ops import linear, pack_linear_weight
from batchserve.shared.lora import PREFIX, PROJECTIONS, AdapterConfig, tensor_name
from batchserve.shared.model import ModelLoadError


@dataclass
class LoraAdapter:
    name: str
    config: AdapterConfig
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, PEFT module) -> (A [r, in], B*scale)

    @classmethod
    def load(
        cls, name: str, folder: str | Path, slots: LoraSlots, num_layers: int, dtype: torch.dtype, device: torch.device
    ) -> LoraAdapter:
        """The adapter's pairs for `slots` (up to its `max_rank`, of its `served` modules, each B split as its
        `split_outputs` says and cut to this tensor-parallel rank's `shards`); ModelLoadError for a target
        outside `served` (`shared.lora.served_projections`)."""
        folder = Path(folder)
        config = AdapterConfig.read(folder, slots.max_rank, slots.served)
        try:
            tensors = {
                tensor_name(key): value for key, value in load_file(folder / "adapter_model.safetensors").items()
            }
        except OSError as exc:
            raise ModelLoadError(f"LoRA adapter {folder}: cannot read adapter_model.safetensors ({exc})") from None
        pairs = {}
        for layer in range(num_layers):
            for module in config.targets:
                group = "self_attn" if PROJECTIONS[module][0] in ("qkv", "o") else "mlp"
                stem = f"{PREFIX}{layer}.{group}.{module}.lora_"
                name_a, name_b = f"{stem}A.weight", f"{stem}B.weight"
                if name_a not in tensors:
                    continue  # a target module absent from a layer (a hybrid model's linear layers): nothing added
                a, b = tensors.pop(name_a), tensors.pop(name_b)
                split = slots.split_outputs.get(module)
                for part, b_part in (split(b) if split else {module: b}).items():
                    a_part, b_part = _shard(a, b_part, slots.shards.get(part))
                    pairs[(layer, part)] = (
                        a_part.to(device=device, dtype=dtype).contiguous(),
                        (b_part.float() * config.scale).to(device=device, dtype=dtype).contiguous(),
                    )
        if tensors:  # `check_adapter` (the api's, before a runtime load) reads the names alone
            raise ModelLoadError(
                f"LoRA adapter {folder}: tensors of no served projection: {', '.join(sorted(tensors)[:3])}"
            )
        return cls(name, config, pairs)


# A LoRA pair's share on one tensor-parallel rank, as its base projection is split: ("rows", s), B's output rows
# s of a column-parallel projection (A whole); ("cols", s), A's input columns s of a row-parallel one (B whole),
# whose partial x . A_s^T . B^T joins the rank's partial output before the ranks' sum.
Shard = tuple[str, slice]


def _shard(a: torch.Tensor, b: torch.Tensor, shard: Shard | None) -> tuple[torch.Tensor, torch.Tensor]:
    if shard is None:
        return a, b
    kind, part = shard
    return (a, b[part]) if kind == "rows" else (a[:, part], b)


class LoraSlots:
    """The loaded adapters (index 0: none, the base model), each slot's, and the step's mask of each row's
    adapter: each adapter owns a run of `columns` (as many as its rank) in every projection's stacked pairs
    (`LoraTarget`), and a row's mask is 1 on its own adapter's run alone."""

    def __init__(
        self,
        max_running_requests: int,
        device: torch.device,
        max_rank: int,
        served: frozenset[str] = frozenset(PROJECTIONS),
    ) -> None:
        self.max_rank = max_rank  # an adapter of a higher rank is refused at load
        self.served = served  # the PEFT modules the model's adapters may target (`shared.lora.served_projections`)
        self.shards: dict[str, Shard] = {}  # each PEFT module's share on this rank (the model's `enable_lora` sets it)
        # PEFT modules the model holds as several projections: B's output rows split into each one's
        # (a gated query: q_proj's per-head query rows, and its gate's as "q_gate"; the model's `enable_lora`)
        self.split_outputs: dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.adapters: dict[int, LoraAdapter] = {}
        self.slot_adapter = np.zeros(max_running_requests, dtype=np.int64)
        self.device = device
        self.dtype = torch.float32
        self.columns: dict[int, tuple[int, int]] = {}  # adapter -> (first stacked column, rank)
        self.version = 0  # bumped by every load: the projections restack
        self.mask: torch.Tensor | None = None  # [tokens, sum of ranks]: 1 on each row's adapter's columns
        self._masks: dict[int, torch.Tensor] = {}  # the mask repeated for projections of several parts
        self._padded: torch.Tensor | None = None  # padded decode steps' masks, at one address per version
        self._padded_version = -1

    @property
    def total_rank(self) -> int:
        return sum(rank for _, rank in self.columns.values())

    def add(self, index: int, adapter: LoraAdapter) -> None:
        self.adapters[index] = adapter
        self.dtype = next(iter(adapter.pairs.values()))[0].dtype if adapter.pairs else self.dtype
        self._restack()

    def remove(self, index: int) -> None:
        """Unload adapter `index` (no slot runs it: the scheduler sends the unload after its last request)."""
        if self.adapters.pop(index, None) is not None:
            self.slot_adapter[self.slot_adapter == index] = 0
            self._restack()

    def _restack(self) -> None:
        """Each adapter's run of stacked columns, anew; the projections restack their pairs on their next use."""
        first, self.columns = 0, {}
        for i in sorted(self.adapters):
            self.columns[i] = (first, self.adapters[i].config.rank)
            first += self.adapters[i].config.rank
        self.version += 1

    def start(self, slot: int, adapter: int) -> None:
        if adapter and adapter not in self.adapters:
            raise ValueError(f"slot {slot}: no LoRA adapter {adapter} loaded")
        self.slot_adapter[slot] = adapter

    def plan(self, slots: list[int], extend_lens: list[int]) -> None:
        """The step's mask of each row's adapter columns (None: no row has an adapter)."""
        per_token = np.repeat(self.slot_adapter[np.asarray(slots, dtype=np.int64)], extend_lens)
        self._masks = {}
        if not per_token.any():
            self.mask = None
            return
        mask = np.zeros((len(per_token), self.total_rank), dtype=np.float32)
        for index in np.unique(per_token[per_token > 0]).tolist():
            first, rank = self.columns[index]
            mask[per_token == index, first : first + rank] = 1.0
        self.mask = torch.from_numpy(mask).to(device=self.device, dtype=self.dtype)

    def pad_rows(self, mask: torch.Tensor | None, size: int, capacity: int) -> None:
        """The step's `mask` (its n decode rows; None: none) as the first rows of `size` in a buffer of `capacity`
        rows that keeps its address while the adapters stay as they are, the padding rows 0 (no adapter): a
        captured CUDA graph of `size` rows reads it there (`procs.worker.graph_runner`)."""
        if self._padded is None or self._padded_version != self.version:
            self._padded = torch.zeros((capacity, self.total_rank), device=self.device, dtype=self.dtype)
            self._padded_version = self.version
        n = 0 if mask is None else mask.shape[0]
        if mask is not None and n:
            self._padded[:n].copy_(mask)
        self._padded[n:size].zero_()
        self.mask, self._masks = self._padded[:size], {}

    def mask_of(self, parts: int) -> torch.Tensor:
        """The step's mask for a projection of `parts` fused parts (each part's stacked pairs one after another)."""
        assert self.mask is not None
        if parts == 1:
            return self.mask
        if parts not in self._masks:
            self._masks[parts] = self.mask.repeat(1, parts)
        return self._masks[parts]

    @property
    def active(self) -> bool:
        return self.mask is not None


@dataclass
class LoraTarget:
    """The LoRA pairs one fused projection of one layer adds: its parts (PEFT module, output columns), every
    adapter's pairs of every part stacked into one A [parts x sum of ranks, in] and one block-diagonal B
    [out, parts x sum of ranks], packed as the base weights are (on the CPU the same C kernels: MKL's threads
    beside theirs would wait out each other's spinning), so a step adds them with two matmuls whatever its
    adapters, each row masked to its own adapter's columns."""

    slots: LoraSlots
    layer: int
    parts: list[tuple[str, slice]]
    _stack: tuple[Any, Any] | None = None
    _version: int = -1

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        stack = self.stack(out.shape[1])
        if stack is not None:
            out += linear(linear(x, stack[0]) * self.slots.mask_of(len(self.parts)), stack[1])
        return out

    def stack(self, width: int) -> tuple[Any, Any] | None:
        """The loaded adapters' stacked A and B (restacked after a load or an unload) for a projection of `width`
        outputs; None where no adapter targets it. The fused C decode call reads them too (`decode_layers.c`)."""
        if self._version != self.slots.version:
            self._stack, self._version = self._stacked(width), self.slots.version
        return self._stack

    def _stacked(self, width: int) -> tuple[Any, Any] | None:
        slots, total = self.slots, self.slots.total_rank
        present = [
            (p, columns, first, rank, pair)
            for p, (module, columns) in enumerate(self.parts)
            for i, (first, rank) in slots.columns.items()
            if (pair := slots.adapters[i].pairs.get((self.layer, module))) is not None
        ]
        if not present:
            return None
        a_like, b_like = present[0][4]
        a = a_like.new_zeros((len(self.parts) * total, a_like.shape[1]))
        b = b_like.new_zeros((width, len(self.parts) * total))
        for p, columns, first, rank, pair in present:
            a[p * total + first : p * total + first + rank] = pair[0]
            b[columns, p * total + first : p * total + first + rank] = pair[1]
        return pack_linear_weight(a, "none"), pack_linear_weight(b, "none")


def attach(layers: list[Any], slots: LoraSlots, q_size: int, kv_size: int, intermediate: int) -> None:
    """Hang `LoraTarget`s on every attention layer's q|k|v and o projections (a hybrid model's linear layers have
    none), and where `slots.served` has them every layer's gate|up and down (the parts' output columns; not on
    a mixture of experts)."""
    for index, layer in enumerate(layers):
        if layer.qkv is not None:
            layer.qkv.lora = LoraTarget(
                slots,
                index,
                [
                    ("q_proj", slice(0, q_size)),
                    ("k_proj", slice(q_size, q_size + kv_size)),
                    ("v_proj", slice(q_size + kv_size, q_size + 2 * kv_size)),
                ],
            )
            layer.o.lora = LoraTarget(slots, index, [("o_proj", slice(None))])
        if "gate_proj" not in slots.served:
            continue
        mlp = layer.mlp
        mlp.gate_up.lora = LoraTarget(
            slots, index, [("gate_proj", slice(0, intermediate)), ("up_proj", slice(intermediate, 2 * intermediate))]
        )
        mlp.down.lora = LoraTarget(slots, index, [("down_proj", slice(None))])
