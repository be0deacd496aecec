"""The registration of the worker's features in its step pipeline (`procs.worker.step_hooks`): the one
place that names each of them. `register_features` runs once, as the runner starts, from what its
configuration loaded; `register_configured` then adds what the server's configuration asks of the built
runner (LoRA, which registers itself when it is enabled: `procs.worker.lora.step.enable_lora`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from batchserve.procs.worker.devices import check_quantization
from batchserve.procs.worker.lora.step import enable_lora, load_lora_adapter
from batchserve.procs.worker.models.base import CausalLM
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.procs.worker.pooling.pooler import SlotPooler
from batchserve.procs.worker.pooling.step import PoolingStep
from batchserve.procs.worker.recurrent.step import RecurrentStateStep
from batchserve.procs.worker.speculation.draft_model import DraftModel
from batchserve.procs.worker.speculation.step import DraftStep
from batchserve.procs.worker.step_hooks import StepHooks
from batchserve.shared.config import ServerConfig
from batchserve.shared.lora import held_at_start, parse_lora_modules
from batchserve.shared.messages import StepResult
from batchserve.shared.model import ModelSpec
from batchserve.shared.pooling import PoolerConfig

if TYPE_CHECKING:
    from batchserve.procs.worker.model_runner import ModelRunner

EXPERT_LOAD_INTERVAL_S = 1.0  # how often a step's result carries a mixture of experts' routed-token counts


def draft_spec_for(
    draft_model: str,
    quantization: str,
    target: ModelSpec,
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
) -> ModelSpec | None:
    """The draft model's spec (None: no draft model), checked before either model loads: a wrong draft
    fails at once."""
    if not draft_model:
        return None
    if tp.world_size > 1:
        raise ValueError("a draft model runs with tensor_parallel_size 1 only")
    check_quantization(quantization, device, dtype)
    return DraftModel.spec_for(draft_model, target)


class ExpertLoadReport:
    """A mixture of experts' routed-token counts, on a step's result about once a second."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._sent = time.monotonic()

    def annotate(self, result: StepResult) -> None:
        if time.monotonic() - self._sent >= EXPERT_LOAD_INTERVAL_S:
            result.expert_load = self.model.take_expert_load()
            self._sent = time.monotonic()


def register_features(
    runner: ModelRunner, draft: CausalLM | None, pooler: PoolerConfig | None, attention_backend: str
) -> StepHooks:
    """The runner's step hooks, with the features its loaded models turn on, in the order their hooks run:
    the recurrent states of a hybrid model, a draft model, the pooling runner's head, the experts' load."""
    hooks, kv_cache = StepHooks(), runner.kv_cache
    if kv_cache.states is not None:
        hooks.register(RecurrentStateStep(kv_cache.states))
    if draft is not None:
        hooks.register(DraftStep(DraftModel.in_pool(draft, kv_cache, attention_backend), kv_cache))
    if pooler is not None:
        slots = SlotPooler(pooler, runner.max_running_requests, runner.config.hidden_size, runner.device)
        hooks.register(PoolingStep(slots, runner.model, runner.attention))
    if getattr(runner.config, "moe", None) is not None:
        hooks.register(ExpertLoadReport(runner.model))
    return hooks


def register_configured(runner: ModelRunner, config: ServerConfig) -> None:
    """The features a server's configuration adds to a built runner: LoRA (refused here, at start, on a model
    that cannot run adapters) and the adapters it holds from the start (index 0 is the base model)."""
    if config.enable_lora:
        enable_lora(runner, config.max_lora_rank)
    modules = held_at_start(parse_lora_modules(config.lora_modules), config.max_cpu_loras)
    for index, module in enumerate(modules, 1):
        load_lora_adapter(runner, index, module.name, module.path)
