"""`LoraStep`: multi-LoRA's hooks in the worker's step pipeline (`procs.worker.step_hooks`).

At start of a step (every rank): the step's adapter loads and unloads (`ForwardBatch.adapter_updates`), then
each new slot's adapter (`SlotStart.adapter`); before the forward pass: which rows run which adapter
(`LoraSlots.plan`). `enable_lora` hangs the slots on the model's projections and registers the hooks."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from batchserve.procs.worker.lora.slots import LoraAdapter, LoraSlots
from batchserve.shared.lora import served_projections
from batchserve.shared.messages import AdapterUpdate, ForwardBatch
from batchserve.shared.model import ModelLoadError, read_model_json

if TYPE_CHECKING:
    from batchserve.procs.worker.model_runner import ModelRunner


class LoraStep:
    def __init__(self, runner: ModelRunner, slots: LoraSlots) -> None:
        self.slots = slots
        self.num_layers = runner.config.num_layers
        self.dtype, self.device = runner.dtype, runner.device

    def start(self, batch: ForwardBatch) -> float:
        """The step's loads and unloads, then each starting slot's adapter; the seconds the loads took."""
        started = time.perf_counter()
        for update in batch.adapter_updates:
            self.update(update)
        for start in batch.slot_starts:
            self.slots.start(start.slot, start.adapter)
        return time.perf_counter() - started if batch.adapter_updates else 0.0

    def before_forward(self, batch: ForwardBatch) -> None:
        self.slots.plan(batch.slots, batch.extend_lens)  # the rows of each adapter

    def after_forward(self, batch: ForwardBatch) -> None:
        pass

    def update(self, update: AdapterUpdate) -> None:
        """Load PEFT adapter `update.path` as adapter `update.index` (>= 1) of the slots that name it
        (`SlotStart.adapter`), or unload that adapter (no path; no slot runs it any more)."""
        if not update.path:
            self.slots.remove(update.index)
            return
        adapter = LoraAdapter.load(update.name, update.path, self.slots, self.num_layers, self.dtype, self.device)
        self.slots.add(update.index, adapter)


def enable_lora(runner: ModelRunner, max_rank: int) -> LoraStep:
    """LoRA slots on the model's projections, their hooks registered (ModelLoadError where its layers
    cannot run adapters)."""
    if runner.hooks.head is not None:
        raise ModelLoadError("LoRA adapters are not served by the pooling runner (embeddings)")
    if runner.hooks.find(LoraStep) is not None:
        raise ModelLoadError("LoRA is enabled already: its slots are on the model's projections")
    served = served_projections(read_model_json(runner.spec.model_dir))
    slots = runner.model.enable_lora(LoraSlots(runner.max_running_requests, runner.device, max_rank, served))
    if runner.graph_runner is not None:
        runner.graph_runner.adapters = slots  # the adapter rows' own decode graphs
    step = LoraStep(runner, slots)
    runner.hooks.register(step)
    return step


def lora_of(runner: ModelRunner) -> LoraSlots | None:
    """The runner's LoRA slots (None: LoRA not enabled)."""
    step = runner.hooks.find(LoraStep)
    return None if step is None else step.slots


def load_lora_adapter(runner: ModelRunner, index: int, name: str, path: str, max_rank: int | None = None) -> None:
    """Adapter `index` from PEFT folder `path` (LoRA enabled first, up to `max_rank`, if it is not yet)."""
    step = runner.hooks.find(LoraStep)
    if step is None:
        if max_rank is None:
            raise ModelLoadError(f"LoRA adapter {name}: the worker was started without enable_lora")
        step = enable_lora(runner, max_rank)
    step.update(AdapterUpdate(index=index, name=name, path=path))
