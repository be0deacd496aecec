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
from batchserve.kernels.triton import enabled as triton_enabled
from batchserve.kernels.triton.lora import RowGroups, add_lora
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
        # The step's rows: each one's adapter, and from it (Triton kernels or not, `kernels.triton`) their groups
        # by adapter or their mask, [tokens, sum of ranks], 1 on each row's adapter's columns
        self.triton = triton_enabled()
        self.row_adapter: np.ndarray | None = None
        self.groups: RowGroups | None = None
        self.mask: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}  # the mask repeated for projections of several parts
        self._padded: torch.Tensor | None = None  # padded decode steps' masks and groups, at one address per version
        self._padded_groups: RowGroups | None = None
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
        """The step's adapter of each row (`row_adapter`; None: no row has one), and from it the rows' mask or,
        with the Triton kernels, their groups."""
        per_token = np.repeat(self.slot_adapter[np.asarray(slots, dtype=np.int64)], extend_lens)
        self.row_adapter = per_token if per_token.any() else None
        self._masks, self.mask, self.groups = {}, None, None
        if self.row_adapter is None:
            return
        if self.triton:
            self.groups = RowGroups.of(per_token, self.stack_size, self.device)
        else:
            self.mask = torch.from_numpy(self._mask_rows(per_token)).to(device=self.device, dtype=self.dtype)

    def _mask_rows(self, row_adapter: np.ndarray) -> np.ndarray:
        mask = np.zeros((len(row_adapter), self.total_rank), dtype=np.float32)
        for index in np.unique(row_adapter[row_adapter > 0]).tolist():
            first, rank = self.columns[index]
            mask[row_adapter == index, first : first + rank] = 1.0
        return mask

    def pad_rows(self, row_adapter: np.ndarray | None, size: int, capacity: int) -> None:
        """The step's rows' adapters (n rows; None: none) as the first of `size` rows, the padding rows 0 (no
        adapter), in buffers of `capacity` rows that keep their addresses while the adapters stay as they
        are: a captured CUDA graph of `size` rows reads them there (`procs.worker.graph_runner`)."""
        rows = np.zeros(size, dtype=np.int64)
        if row_adapter is not None:
            rows[: len(row_adapter)] = row_adapter
        if self._padded is None or self._padded_version != self.version:
            self._padded = torch.zeros((capacity, self.total_rank), device=self.device, dtype=self.dtype)
            self._padded_groups = RowGroups.of(np.zeros(capacity, dtype=np.int64), self.stack_size, self.device)
            self._padded_version = self.version
        self._masks = {}
        if self.triton:
            assert self._padded_groups is not None
            self._padded_groups.copy_(RowGroups.of(rows, self.stack_size, self.device))
            self.groups = self._padded_groups
        else:
            self._padded[:size].copy_(torch.from_numpy(self._mask_rows(rows)))
            self.mask = self._padded[:size]

    @property
    def stack_size(self) -> int:
        """Entries of the Triton kernels' per-adapter stacks: the highest adapter index + 1 (0: the base)."""
        return max(self.adapters, default=0) + 1

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
        return self.mask is not None or self.groups is not None


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
    _grouped: tuple[torch.Tensor, torch.Tensor] | None = None
    _grouped_version: int = -1

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.slots.groups is not None:  # the Triton kernels, over the rows grouped by adapter
            grouped = self.grouped(out.shape[1])
            return out if grouped is None else add_lora(x, *grouped, self.slots.groups, out)
        stack = self.stack(out.shape[1])
        if stack is not None:
            out += linear(linear(x, stack[0]) * self.slots.mask_of(len(self.parts)), stack[1])
        return out

    def grouped(self, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The Triton kernels' stacks, one entry per adapter index (0, the base, and unloaded ones: zeros):
        A [adapters, parts x highest rank, in] and B [adapters, width, parts x highest rank], each part's
        pair in its run of the rank columns and its output columns of B; None where no adapter targets it."""
        if self._grouped_version != self.slots.version:
            self._grouped, self._grouped_version = self._grouped_pairs(width), self.slots.version
        return self._grouped

    def _grouped_pairs(self, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        slots = self.slots
        rank = max((adapter.config.rank for adapter in slots.adapters.values()), default=0)
        present = [
            (p, columns, i, pair)
            for p, (module, columns) in enumerate(self.parts)
            for i, adapter in slots.adapters.items()
            if (pair := adapter.pairs.get((self.layer, module))) is not None
        ]
        if not present:
            return None
        a_like, b_like = present[0][3]
        a = a_like.new_zeros((slots.stack_size, len(self.parts) * rank, a_like.shape[1]))
        b = b_like.new_zeros((slots.stack_size, width, len(self.parts) * rank))
        for p, columns, i, (pair_a, pair_b) in present:
            a[i, p * rank : p * rank + pair_a.shape[0]] = pair_a
            b[i, columns, p * rank : p * rank + pair_a.shape[0]] = pair_b
        return a, b

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
