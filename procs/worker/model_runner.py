"""`ModelRunner`: the worker's engine core. Owns the model, the KV pool and the page table, and
executes one `ForwardBatch` per call as the stages of the step pipeline (`procs.worker.step_hooks`): apply
page-table updates, run the packed forward, sample; the features it was started with plug in at the
pipeline's hooks (registered by `procs.worker.features`).

With tensor parallelism one `ModelRunner` runs on every rank, each with its share of the model and
of the KV heads (`procs.worker.parallel`): rank 0's `execute` broadcasts the step
(`procs.worker.rank_steps`) and samples; the others run the broadcast steps in `follow`.

Beside it: the KV pool it builds for its model (`procs.worker.kv_pool`), the other parts it settles at
start (`procs.worker.runner_setup`: the attention backend every rank agrees on, CUDA graphs, the pooling
rule), and the sampling of a step's logits (`procs.worker.step_sampler`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from batchserve.kernels.triton import select as triton_kernels_select
from batchserve.procs.worker.batch_checks import check_batch
from batchserve.procs.worker.devices import check_quantization, resolve_device, resolve_dtype
from batchserve.procs.worker.features import draft_spec_for, register_configured, register_features
from batchserve.procs.worker.grammar_masks import SlotGrammars
from batchserve.procs.worker.kv_cache import kv_memory_budget_gb
from batchserve.procs.worker.kv_pool import build_kv_pool
from batchserve.procs.worker.loader import load_model
from batchserve.procs.worker.logits_state import SlotLogitsState
from batchserve.procs.worker.models.base import CausalLM, ModelConfig, eager_forward
from batchserve.procs.worker.parallel import TensorParallel, join, rank_device
from batchserve.procs.worker.rank_steps import RankStep, RankSteps, RankStop
from batchserve.procs.worker.runner_setup import (
    agreed_backend,
    attention_for,
    cost_windows,
    decode_graph_runner,
    pooler_rule,
    ring_rows_within,
)
from batchserve.procs.worker.sample_rows import sampled_tokens
from batchserve.procs.worker.step_sampler import StepSampler
from batchserve.procs.worker.weight_bytes import weight_bytes
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import ForwardBatch, StepResult
from batchserve.shared.model import ModelSpec
from batchserve.shared.parallel import RankLayout
from batchserve.shared.pooling import PoolerConfig
from batchserve.shared.process_messages import WorkerInfo
from batchserve.shared.step_features import StepShape

log = logging.getLogger("batchserve.worker")
# BATCHSERVE_DEBUG_CHECKS=1: check every ForwardBatch before running it (`procs.worker.batch_checks`). The
# scheduler plans batches that pass by construction; the check is for debugging a scheduler change.
DEBUG_CHECKS = os.environ.get("BATCHSERVE_DEBUG_CHECKS", "") not in ("", "0")


class ModelRunner:
    """Executes `ForwardBatch`es on one model replica.

    KV capacity: `kv_capacity_tokens` if > 0 (rounded up to whole pages), else as many pages as
    `kv_memory_gb` GiB holds (0: `kv_memory_fraction` of the CUDA memory free after the weights, 1 GiB
    on the CPU; see `kv_memory_budget_gb`); page 0 is the dummy page and is not counted in `kv_capacity_tokens`.
    `max_context` 0 means the model's max_position_embeddings. `pad_decode`: run decode steps on the
    padded static buffers CUDA graphs replay (None: only where graphs are captured).
    `draft_model`: a model with this one's tokenizer that proposes speculative decoding's draft tokens
    (`procs.worker.speculation.draft_model`; its weights in `draft_quantization`), its KV in this pool's pages.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str = "auto",
        dtype: str = "auto",
        page_size: int = 16,
        kv_capacity_tokens: int = 0,
        kv_memory_gb: float = 0.0,
        kv_memory_fraction: float = 0.85,
        max_running_requests: int = 64,
        max_context: int = 0,
        attention_backend: str = "auto",
        triton_kernels: str = "auto",
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int = 0,
        pad_decode: bool | None = None,
        quantization: str = "auto",
        tp: TensorParallel | None = None,
        draft_model: str = "",
        draft_quantization: str = "auto",
        ring_step_tokens: int = 0,
        state_snapshots: int = 0,
        runner: str = "generate",
        pooling: str = "",
    ):
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.spec = ModelSpec.resolve(model, max_context)  # what the other processes see of the model
        self.tp = tp or TensorParallel()
        self.rank_steps = RankSteps(self.tp)
        self.device = self.tp.device if self.tp.layout.picks_device else resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        triton_kernels_select(triton_kernels, self.device)
        draft, pooler = self._load_models(quantization, draft_model, draft_quantization, runner, pooling)
        self.weight_bytes = weight_bytes(self.model)  # now, before steps cache the KV pool's views on it
        backend = agreed_backend(attention_backend, self.device, self.dtype, self.tp)
        self.kv_cache = build_kv_pool(
            self.model,
            draft,
            tp=self.tp,
            dtype=self.dtype,
            device=self.device,
            max_context=self.spec.context_length,
            page_size=page_size,
            capacity_tokens=kv_capacity_tokens,
            budget_gb=lambda: kv_memory_budget_gb(self.device, kv_memory_gb, kv_memory_fraction),
            max_running=max_running_requests,
            ring_step_tokens=ring_rows_within(backend, ring_step_tokens),
            state_snapshots=state_snapshots,
        )
        self.tp.start_serving()  # the last start-up agreement is done: steps' collectives get the step timeout
        self.attention = attention_for(backend, self.model, self.kv_cache)
        self.cost_windows = cost_windows(self.model, self.tp, self.dtype)
        self.hooks = register_features(self, draft, pooler, attention_backend)  # (`procs.worker.step_hooks`)
        self._start_slots(max_running_requests)
        disable_cuda_graph = disable_cuda_graph or self.hooks.head is not None  # a head that is not sampling
        self.graph_runner = decode_graph_runner(
            self.model, self.attention, self.kv_cache, self.tp, disable_cuda_graph, cuda_graph_max_bs, pad_decode
        )

    def _load_models(
        self, quantization: str, draft_model: str, draft_quantization: str, runner: str, pooling: str
    ) -> tuple[CausalLM | None, PoolerConfig | None]:
        """Load the model (`self.model`, `self.config`), and the draft model if there is one (its weights
        load before the pool is sized from the memory left; its KV will share the pool's pages); the draft,
        and the pooling runner's rule (None: the generate runner)."""
        check_quantization(quantization, self.device, self.dtype)
        draft_spec = draft_spec_for(draft_model, draft_quantization, self.spec, self.tp, self.device, self.dtype)
        pooler = pooler_rule(self.spec, self.tp, runner, pooling)
        self.model: CausalLM = load_model(
            self.spec,
            dtype=self.dtype,
            device=self.device,
            quantization=quantization,
            tp=self.tp,
            lm_head=pooler is None or bool(pooler.logit_tokens),
        )
        self.config: ModelConfig = self.model.config
        if draft_spec is None:
            return None, pooler
        return load_model(draft_spec, dtype=self.dtype, device=self.device, quantization=draft_quantization), pooler

    def _start_slots(self, max_running_requests: int) -> None:
        """What each request slot keeps between steps, beside what its features keep: its grammar, its
        sampling state and last token (`self.sampler`), and its prompt's length."""
        self.grammars = SlotGrammars(
            max_running_requests, self.config.vocab_size, device=self.device, tokenizer=self.spec.grammar_tokenizer
        )
        self.sampler = StepSampler(
            SlotLogitsState(max_running_requests, self.config.vocab_size, self.device, self.grammars),
            max_running_requests,
            self.device,
            self.hooks.verifier,
        )
        self.prompt_lens = np.zeros(max_running_requests, dtype=np.int64)  # each slot's SlotStart.prompt_len

    @classmethod
    def from_config(
        cls, config: ServerConfig, local_rank: int = 0, joining: Callable[[], object] | None = None
    ) -> ModelRunner:
        """The runner of worker rank `local_rank` of this machine (with tensor_parallel_size > 1 it joins
        the other ranks first, calling `joining` just before, and every rank must be built)."""
        layout = RankLayout.of(config, local_rank)
        tp = join(config, layout, rank_device(resolve_device(config.device), layout), joining)
        try:
            runner = cls(
                config.model,
                device=config.device,
                dtype=config.dtype,
                page_size=config.page_size,
                kv_capacity_tokens=config.kv_capacity_tokens,
                kv_memory_gb=config.kv_memory_gb,
                kv_memory_fraction=config.kv_memory_fraction,
                max_running_requests=config.max_running_requests,
                max_context=config.max_context,
                attention_backend=config.attention_backend,
                triton_kernels=config.triton_kernels,
                disable_cuda_graph=config.disable_cuda_graph,
                cuda_graph_max_bs=config.cuda_graph_max_bs,
                quantization=config.quantization,
                tp=tp,
                draft_model=config.draft_model if config.speculative == "draft" else "",
                draft_quantization=config.draft_quantization,
                ring_step_tokens=0
                if config.full_sliding_kv
                else max(config.prefill_budget, config.num_speculative_tokens + 1),
                # a hybrid model's prefix cache keeps states: as many as requests run at once
                state_snapshots=0 if config.disable_prefix_cache else config.max_running_requests,
                runner=config.runner,
                pooling=config.pooling,
            )
            register_configured(runner, config)
        except BaseException:
            tp.close()
            raise
        return runner

    def close(self) -> None:
        """Rank 0: tell the followers to stop; every rank: leave the group."""
        try:
            if self.tp.is_first:
                self.rank_steps.stop()
        except RuntimeError as exc:  # a follower is gone already: nothing left to tell
            log.warning("could not tell the other worker ranks to stop: %s", exc)
        finally:
            self.tp.close()

    def follow(self, keep_following: Callable[[], bool] = lambda: True) -> None:
        """A follower rank's serving loop: run each step rank 0 broadcasts, until it stops or
        `keep_following` (asked at every message, rank 0's idle ticks included) says no."""
        while True:
            message = self.rank_steps.follow()
            if isinstance(message, RankStop) or not keep_following():
                return
            if isinstance(message, RankStep):
                self.hooks.start(message.batch)  # rank 0's `execute` does the same
                with torch.inference_mode():
                    self._forward(message.batch, message.logits_rows)

    # -- properties the scheduler sizes itself by ---------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_cache.kv_capacity_tokens

    @property
    def page_size(self) -> int:
        return self.kv_cache.page_size

    @property
    def max_context(self) -> int:
        return self.spec.context_length

    @property
    def max_running_requests(self) -> int:
        return self.kv_cache.max_running_requests

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.spec.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def worker_info(self, step_costs: list[tuple[StepShape, float]] | None = None) -> WorkerInfo:
        """What the scheduler sizes itself by (sent by the worker process at start)."""
        moe, states = getattr(self.config, "moe", None), self.kv_cache.states
        return WorkerInfo(
            kv_capacity_tokens=self.kv_capacity_tokens,
            eos_token_ids=list(self.eos_token_ids),
            max_context=self.max_context,
            page_size=self.page_size,
            device_type=self.device.type,
            step_costs=step_costs or [],
            moe_experts=moe.num_experts if moe else 0,
            moe_top_k=moe.top_k if moe else 0,
            rope_switch_length=self.model.rope.switch_length,
            rope_dynamic_length=self.model.rope.dynamic_length,
            sliding_window=self._shared_window(),
            layer_windows=list(self.cost_windows),
            sliding_rings=bool(self.kv_cache.ring_layers),
            weight_bytes=self.weight_bytes,
            recurrent_state_bytes=0 if states is None else states.bytes_per_request,
            state_snapshots=0 if states is None else states.num_snapshots,
            pooling=self.hooks.head is not None,
            bidirectional=self.config.bidirectional,
        )

    def _shared_window(self) -> int:
        """Every layer's window where they share one, and no feature that rewrites the rows (a draft model)
        reads the KV whole; else 0."""
        windows = set(self.config.windows)
        return windows.pop() if len(windows) == 1 and not self.hooks.rewrites else 0

    # -- one step ---------------------------------------------------------------------------------

    def execute(self, batch: ForwardBatch) -> StepResult:
        """One step, as the stages of `procs.worker.step_hooks` (the features' hooks between them)."""
        if DEBUG_CHECKS:
            self._check(batch)
        batch = self.sampler.fill_future_tokens(batch)
        captured_before = self._captured_s()
        setup_s = self.hooks.start(batch)
        self.sampler.start(batch.slot_starts)
        batch = self.hooks.rewrite(batch)
        with torch.inference_mode():
            if self.hooks.head is not None:  # a step that ends in something other than tokens
                return self._head_step(batch)
            prompt_chunks, extra_rows = self.sampler.prompt_rows(batch)
            logits = self.step_logits(batch, extra_rows)
            result = StepResult(
                step=batch.step,
                next_token_ids=np.zeros(0, dtype=np.int32),
                setup_s=setup_s + self._captured_s() - captured_before,
            )
            self.hooks.annotate(result)
            if logits is not None:
                self.sampler.sample(batch, logits, prompt_chunks, result)
        return result

    def _head_step(self, batch: ForwardBatch) -> StepResult:
        """The step of a head that replaces sampling: its forward pass (`forward_logits`), then its result."""
        assert self.hooks.head is not None
        hidden = self.step_logits(batch)
        assert hidden is not None
        return self.hooks.head.result(batch, hidden)

    def _check(self, batch: ForwardBatch) -> None:
        limits = (self.max_running_requests, self.spec.context_length, self.kv_cache.num_pages * self.page_size)
        check_batch(batch, *limits, self.vocab_size, bool(self.hooks.rewrites))

    def _captured_s(self) -> float:
        return self.graph_runner.capture_seconds if self.graph_runner else 0.0

    def step_logits(self, batch: ForwardBatch, extra_rows: np.ndarray | None = None) -> torch.Tensor | None:
        """Rank 0: the forward part of a step, broadcast to the other ranks: page table applied, the
        model run, float32 logits of the sampled positions, then of `extra_rows` (packed token
        indices). Not the rest of `execute`: `batch`'s inputs are used as they are (`FUTURE_TOKEN`s
        unfilled) and its slot starts are not applied, nothing is sampled."""
        self.rank_steps.lead(batch, extra_rows)
        return self._forward(batch, extra_rows)

    def _forward(self, batch: ForwardBatch, extra_rows: np.ndarray | None) -> torch.Tensor | None:
        """One step's page-table updates and forward pass, as every rank runs it."""
        self.kv_cache.apply_page_table_updates(batch.page_table_slots, batch.page_table_cols, batch.page_table_pages)
        self.hooks.before_forward(batch)
        logits = self.forward_logits(self._rope_rows(batch), extra_rows)
        self.hooks.after_forward(batch)
        return logits

    def _rope_rows(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch with its positions as rows of the model's rope tables: the positions themselves,
        unless the rope switches factors with the length (then the slots' prompt lengths decide too,
        `kernels.rope`)."""
        rope = self.model.rope
        for start in batch.slot_starts:  # dynamic NTK: a recompute keeps the frequencies the keys first had
            self.prompt_lens[start.slot] = (rope.dynamic_length and start.client_prompt_len) or start.prompt_len
        if not rope.follows_length:
            return batch
        prompt_lens = np.repeat(self.prompt_lens[np.asarray(batch.slots, dtype=np.int64)], batch.extend_lens)
        return msgspec.structs.replace(batch, positions=rope.rows(batch.positions, prompt_lens))

    def forward_logits(self, batch: ForwardBatch, extra_rows: np.ndarray | None = None) -> torch.Tensor | None:
        """Run the batch's forward pass (page table already applied): float32 logits of the sampled
        positions (each row's last sample_lens[i] tokens), then of `extra_rows` (packed token indices),
        or None if there are none."""
        if self.hooks.head is not None:  # a head's forward pass (the pooling runner: every token's hidden state)
            return self.hooks.head.forward(batch)
        if extra_rows is None and self.graph_runner and self.graph_runner.handles(batch):
            return self.graph_runner.forward_logits(batch)
        rows = sampled_tokens(batch.extend_lens, batch.sample_lens)
        if extra_rows is not None:
            rows = np.concatenate([rows, extra_rows])
        return eager_forward(
            self.model,
            self.attention,
            batch.slots,
            batch.prefix_lens,
            batch.extend_lens,
            batch.input_ids,
            batch.positions,
            batch.kv_locs,
            rows,
        )
