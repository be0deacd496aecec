"""`ModelRunner`: the worker's engine core. Owns the model, the KV pool and the page table, and
executes one `ForwardBatch` per call: apply page-table updates, run the packed forward, sample.

With tensor parallelism one `ModelRunner` runs on every rank, each with its share of the model and
of the KV heads (`procs.worker.parallel`): rank 0's `execute` broadcasts the step
(`procs.worker.rank_steps`) and samples; the others run the broadcast steps in `follow`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from batchserve.kernels.attention import BACKENDS, create_backend, resolve_backend_name
from batchserve.kernels.kv_cache import KVCache
from batchserve.kernels.recurrent_state import RecurrentStatePool
from batchserve.kernels.sampling import rejection_sample, sample_batch, sample_with_scores, speculative_noise
from batchserve.procs.worker.batch_checks import check_batch
from batchserve.procs.worker.devices import check_quantization, resolve_device, resolve_dtype
from batchserve.procs.worker.draft_model import DraftDistributions, DraftModel
from batchserve.procs.worker.grammar_masks import SlotGrammars
from batchserve.procs.worker.graph_runner import DecodeGraphRunner
from batchserve.procs.worker.kv_cache import (
    GIB,
    kv_bytes_per_token,
    kv_memory_budget_gb,
    num_pages_for,
    ring_layers,
    ring_pages_for,
)
from batchserve.procs.worker.loader import load_model
from batchserve.procs.worker.logits_state import SlotLogitsState
from batchserve.procs.worker.lora import LoraAdapter, LoraSlots
from batchserve.procs.worker.models.base import CausalLM, ModelConfig, eager_forward, eager_hidden_states
from batchserve.procs.worker.parallel import TensorParallel, join, rank_device
from batchserve.procs.worker.pooler import SlotPooler
from batchserve.procs.worker.rank_steps import RankStep, RankSteps, RankStop
from batchserve.procs.worker.sample_rows import SampleRows, sampled_tokens
from batchserve.shared.config import ServerConfig
from batchserve.shared.lora import held_at_start, parse_lora_modules, served_projections
from batchserve.shared.messages import (
    FUTURE_TOKEN,
    AdapterUpdate,
    ForwardBatch,
    SamplingParams,
    StepResult,
    TokenLogprobs,
    WorkerInfo,
)
from batchserve.shared.model import ModelLoadError, ModelSpec, read_model_json
from batchserve.shared.parallel import RankLayout
from batchserve.shared.pooling import PoolerConfig, pooler_for
from batchserve.shared.step_features import StepShape, layer_cost_windows

log = logging.getLogger("batchserve.worker")
# BATCHSERVE_DEBUG_CHECKS=1: check every ForwardBatch before running it (`procs.worker.batch_checks`). The
# scheduler plans batches that pass by construction; the check is for debugging a scheduler change.
DEBUG_CHECKS = os.environ.get("BATCHSERVE_DEBUG_CHECKS", "") not in ("", "0")
EXPERT_LOAD_INTERVAL_S = 1.0  # how often a step's result carries a mixture of experts' routed-token counts


class ModelRunner:
    """Executes `ForwardBatch`es on one model replica.

    KV capacity: `kv_capacity_tokens` if > 0 (rounded up to whole pages), else as many pages as
    `kv_memory_gb` GiB holds (0: `kv_memory_fraction` of the CUDA memory free after the weights, 1 GiB
    on the CPU; see `kv_memory_budget_gb`); page 0 is the dummy page and is not counted in `kv_capacity_tokens`.
    `max_context` 0 means the model's max_position_embeddings. `pad_decode`: run decode steps on the
    padded static buffers CUDA graphs replay (None: only where graphs are captured).
    `draft_model`: a model with this one's tokenizer that proposes speculative decoding's draft tokens
    (`procs.worker.draft_model`; its weights in `draft_quantization`), its KV in this pool's pages.
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
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int = 0,
        pad_decode: bool | None = None,
        quantization: str = "none",
        tp: TensorParallel | None = None,
        draft_model: str = "",
        draft_quantization: str = "none",
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
        check_quantization(quantization, self.device, self.dtype)
        draft_spec = None
        if draft_model:  # checked before either model loads: a wrong draft fails at once
            if self.tp.world_size > 1:
                raise ValueError("a draft model runs with tensor_parallel_size 1 only")
            check_quantization(draft_quantization, self.device, self.dtype)
            draft_spec = DraftModel.spec_for(draft_model, self.spec)
        self._max_context = self.spec.context_length
        pooler = self._pooler(runner, pooling)  # None: the generate runner
        self.model: CausalLM = load_model(
            self.spec,
            dtype=self.dtype,
            device=self.device,
            quantization=quantization,
            tp=self.tp,
            lm_head=pooler is None or bool(pooler.logit_tokens),
        )
        self.config: ModelConfig = self.model.config
        cfg, heads = self.config, self.model.heads
        # The draft's weights load before the pool is sized from the memory left; its KV shares the pool's pages.
        draft = (
            None
            if draft_spec is None
            else load_model(draft_spec, dtype=self.dtype, device=self.device, quantization=draft_quantization)
        )
        backend = self._agreed_backend(attention_backend)
        ring_rows = BACKENDS[backend]().ring_row_tokens if backend in BACKENDS else None
        self.kv_cache = self._kv_cache(
            page_size,
            kv_capacity_tokens,
            lambda: kv_memory_budget_gb(self.device, kv_memory_gb, kv_memory_fraction),
            max_running_requests,
            draft,
            min(ring_step_tokens, ring_rows or ring_step_tokens),
            state_snapshots,
        )
        self.tp.start_serving()  # the last start-up agreement is done: steps' collectives get the step timeout
        self.attention = create_backend(
            backend,
            self.kv_cache,
            heads.num_heads,
            heads.num_kv_heads,
            cfg.head_dim,
            cfg.attention_scale,
            cfg.windows,
            cfg.attn_softcap,
            causal=not cfg.bidirectional,
        )
        self.draft: DraftModel | None = (
            None if draft is None else DraftModel.in_pool(draft, self.kv_cache, attention_backend)
        )
        # the step-cost model's windows: a linear layer's is what its state's reads cost, in keys
        self.cost_windows = layer_cost_windows(
            cfg.windows,
            cfg.linear_layers,
            cfg.num_layers,
            0 if cfg.recurrent is None else cfg.recurrent.of_ranks(self.tp.world_size).bytes_per_request(self.dtype),
            kv_bytes_per_token(1, heads.num_kv_heads, cfg.head_dim, self.dtype),
        )
        self.grammars = SlotGrammars(
            max_running_requests, cfg.vocab_size, device=self.device, tokenizer=self.spec.grammar_tokenizer
        )
        self.logits_state = SlotLogitsState(max_running_requests, cfg.vocab_size, self.device, self.grammars)
        self.last_sampled = np.zeros(max_running_requests, dtype=np.int32)  # what FUTURE_TOKEN inputs feed
        self.lora: LoraSlots | None = None  # LoRA adapters, with enable_lora (`update_lora_adapter`)
        self.prompt_lens = np.zeros(max_running_requests, dtype=np.int64)  # each slot's SlotStart.prompt_len
        self.pooler = None if pooler is None else SlotPooler(pooler, max_running_requests, cfg.hidden_size, self.device)
        disable_cuda_graph = disable_cuda_graph or pooler is not None  # the pooling runner never decodes
        self._expert_load_sent = time.monotonic()
        self.graph_runner = self._graph_runner(disable_cuda_graph, cuda_graph_max_bs, pad_decode)

    def _pooler(self, runner: str, pooling: str) -> PoolerConfig | None:
        """The pooling runner's rule for this model (`shared.pooling`), logged; None for the generate runner."""
        pooler = pooler_for(
            self.spec.model_dir, self.spec.architecture, read_model_json(self.spec.model_dir), runner, pooling
        )
        if pooler is not None:
            if self.tp.world_size > 1:  # (its heads run on rank 0 alone, outside the ranks' broadcast steps)
                raise ModelLoadError("the pooling runner runs with tensor_parallel_size 1")
            log.info(
                "pooling runner: %s pooling%s (from %s)",
                pooler.pooling,
                ", normalised" if pooler.normalize else "",
                pooler.source,
            )
        return pooler

    def _kv_cache(
        self,
        page_size: int,
        capacity_tokens: int,
        budget_gb: Callable[[], float],
        max_running: int,
        draft: CausalLM | None,
        ring_step_tokens: int,
        state_snapshots: int,
    ) -> KVCache:
        """The KV pool: rings for the sliding layers where they apply (rows of at most `ring_step_tokens` read
        through them, no draft model reading the KV whole; `procs.worker.kv_cache.ring_layers`), a hybrid
        model's per-slot recurrent states, and pages for the other layers (and the draft's) for
        `capacity_tokens`, or as many as the memory budget left after the rings and states holds. Each rank
        sizes its pool from its own memory; all take the smallest, which the scheduler plans with."""
        cfg, heads = self.config, self.model.heads
        rings = ring_layers(cfg.windows, ring_step_tokens if draft is None else 0)
        window = max((cfg.windows[layer] for layer in rings), default=0)
        ring_pages = ring_pages_for(window, ring_step_tokens, page_size) if rings else 0
        if ring_pages * page_size >= self._max_context:  # a ring would hold the whole context: no gain
            rings, window, ring_pages = (), 0, 0
        layer_bytes = kv_bytes_per_token(1, heads.num_kv_heads, cfg.head_dim, self.dtype)
        kv_layers = len(cfg.kv_layers)
        bytes_per_token = layer_bytes * (kv_layers - len(rings)) or layer_bytes
        if draft is not None:
            bytes_per_token += kv_bytes_per_token(
                draft.config.num_layers, draft.heads.num_kv_heads, draft.config.head_dim, self.dtype
            )
        states = (
            None
            if cfg.recurrent is None
            else RecurrentStatePool(
                num_layers=len(cfg.linear_layers),
                shape=cfg.recurrent.of_ranks(self.tp.world_size),
                max_running_requests=max_running,
                dtype=self.dtype,
                device=self.device,
                snapshots=state_snapshots,
            )
        )
        fixed_gb = layer_bytes * len(rings) * (1 + max_running * ring_pages) * page_size / GIB
        fixed_gb += 0 if states is None else states.memory_bytes / GIB
        budget = 0.0 if capacity_tokens > 0 else budget_gb() - fixed_gb
        if capacity_tokens <= 0 and budget <= 0:
            raise ValueError(
                f"the sliding layers' rings and the recurrent states take {fixed_gb:.2f} GiB of KV "
                f"memory, the whole budget: lower --max-running-requests or raise --kv-memory-gb"
            )
        num_pages = self.tp.min_int(
            num_pages_for(page_size, capacity_tokens=capacity_tokens, memory_gb=budget, bytes_per_token=bytes_per_token)
        )
        return KVCache(
            num_layers=kv_layers,
            num_kv_heads=heads.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=page_size,
            num_pages=num_pages,
            max_running_requests=max_running,
            max_pages_per_request=-(-self._max_context // page_size),
            dtype=self.dtype,
            device=self.device,
            ring_layers=rings,
            ring_pages=ring_pages,
            ring_window=window,
            states=states,
        )

    def _graph_runner(
        self, disable_cuda_graph: bool, cuda_graph_max_bs: int, pad_decode: bool | None
    ) -> DecodeGraphRunner | None:
        """Decode batches up to cuda_graph_max_bs (0: max_running_requests) run padded on static buffers
        where they replay CUDA graphs; disable_cuda_graph: every step runs the plain eager path. Without
        graphs (CPU) padding is pure cost (the padded rows run the whole model), so decode runs unpadded
        there unless pad_decode asks for it."""
        if cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {cuda_graph_max_bs}")
        padded = DecodeGraphRunner.can_capture(self.attention) if pad_decode is None else pad_decode
        padded = bool(self.tp.min_int(int(padded)))  # padding changes the collectives' shapes: all ranks or none
        if disable_cuda_graph or not padded:
            return None
        most = self.max_running_requests
        return DecodeGraphRunner(
            self.model, self.attention, self.kv_cache, max_batch_size=min(cuda_graph_max_bs or most, most)
        )

    def _agreed_backend(self, name: str) -> str:
        """`name` resolved ("auto": by what this machine has), the same on every rank: each runs the same
        steps, and a backend decides whether decode steps are padded, so the collectives' shapes."""
        resolved = resolve_backend_name(name, self.device.type, self.dtype)
        if self.tp.world_size == 1 or resolved not in BACKENDS:
            return resolved  # an unknown name: create_backend refuses it, on every rank alike
        names = sorted(BACKENDS)
        index = names.index(resolved)
        lowest, highest = self.tp.min_int(index), self.tp.max_int(index)
        if lowest != highest:
            raise ValueError(
                f"attention_backend {name}: the worker ranks resolved it differently ({names[lowest]} "
                f"on some, {names[highest]} on others); set the same backend on every machine"
            )
        return resolved

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
            if config.enable_lora:  # refused here, at start, on a model that cannot run adapters
                runner.enable_lora(config.max_lora_rank)
            modules = held_at_start(parse_lora_modules(config.lora_modules), config.max_cpu_loras)
            for index, module in enumerate(modules, 1):  # index 0: the base model
                runner.load_lora_adapter(index, module.name, module.path)
        except BaseException:
            tp.close()
            raise
        return runner

    def enable_lora(self, max_rank: int) -> LoraSlots:
        """LoRA slots on the model's projections (ModelLoadError where its layers cannot run adapters)."""
        if self.pooler is not None:
            raise ModelLoadError("LoRA adapters are not served by the pooling runner (embeddings)")
        served = served_projections(read_model_json(self.spec.model_dir))
        self.lora = self.model.enable_lora(LoraSlots(self.max_running_requests, self.device, max_rank, served))
        return self.lora

    def load_lora_adapter(self, index: int, name: str, path: str, max_rank: int | None = None) -> None:
        """Adapter `index` from PEFT folder `path` (LoRA enabled first, up to `max_rank`, if it is not yet)."""
        if self.lora is None and max_rank is not None:
            self.enable_lora(max_rank)
        self.update_lora_adapter(AdapterUpdate(index=index, name=name, path=path))

    def update_lora_adapter(self, update: AdapterUpdate) -> None:
        """Load PEFT adapter `update.path` as adapter `update.index` (>= 1) of the slots that name it
        (`SlotStart.adapter`), or unload that adapter (no path; no slot runs it any more)."""
        if self.lora is None:
            raise ModelLoadError(f"LoRA adapter {update.name}: the worker was started without enable_lora")
        if not update.path:
            self.lora.remove(update.index)
            return
        self.lora.add(
            update.index,
            LoraAdapter.load(update.name, update.path, self.lora, self.config.num_layers, self.dtype, self.device),
        )

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
                self._start_adapters(message.batch)  # rank 0's `execute` does the same
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
        return self._max_context

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
            recurrent_state_bytes=0 if states is None else states.bytes_per_request,
            state_snapshots=0 if states is None else states.num_snapshots,
            pooling=self.pooler is not None,
            bidirectional=self.config.bidirectional,
        )

    def _shared_window(self) -> int:
        """Every layer's window where they share one, and no draft model reads the KV whole; else 0."""
        windows = set(self.config.windows)
        return windows.pop() if len(windows) == 1 and self.draft is None else 0

    # -- one step ---------------------------------------------------------------------------------

    def execute(self, batch: ForwardBatch) -> StepResult:
        if DEBUG_CHECKS:
            check_batch(
                batch,
                self.max_running_requests,
                self._max_context,
                self.kv_cache.num_pages * self.page_size,
                self.vocab_size,
                self.draft is not None,
            )
        batch = self._fill_future_tokens(batch)
        captured_before = self.graph_runner.capture_seconds if self.graph_runner else 0.0
        loading_s = self._start_adapters(batch)
        for start in batch.slot_starts:
            self.logits_state.start(start)
        drafts = None
        if self.draft is not None:  # it runs every step, so that its KV holds what the model's holds
            for start in batch.slot_starts:
                self.draft.start(start.slot)
            batch, drafts = self.draft.propose(self._apply_page_table(batch))
        if self.pooler is not None:
            return self._pooled_step(batch)
        with torch.inference_mode():
            prompt_chunks = self.logits_state.prompt_logprob_chunks(batch.slots, batch.prefix_lens, batch.extend_lens)
            extra_rows = np.concatenate([rows for _, _, rows in prompt_chunks]) if prompt_chunks else None
            logits = self.step_logits(batch, extra_rows)
            num_sampled = batch.num_sampled
            captured_s = (self.graph_runner.capture_seconds if self.graph_runner else 0.0) - captured_before
            result = StepResult(
                step=batch.step,
                next_token_ids=np.zeros(0, dtype=np.int32),
                setup_s=loading_s + captured_s,
                draft_s=0.0 if self.draft is None else self.draft.proposing_s,
            )
            if time.monotonic() - self._expert_load_sent >= EXPERT_LOAD_INTERVAL_S:
                result.expert_load = self.model.take_expert_load()
                self._expert_load_sent = time.monotonic()
            if logits is None:
                return result
            if prompt_chunks:
                result.prompt_logprobs = self.logits_state.chunks_prompt_logprobs(prompt_chunks, logits[num_sampled:])
            if num_sampled:
                rows = SampleRows.of_batch(batch)
                sampling = [p for p, n in zip(batch.sampling, batch.sample_lens) for _ in range(n)]
                token_ids, result.logprob_rows, result.logprobs = self._sample(
                    logits[:num_sampled], sampling, rows, drafts
                )
                result.next_token_ids = token_ids.to(torch.int32).cpu().numpy()
                kept_rows, kept = rows, None
                if rows.width > 1:  # proposed tokens: keep what verification accepts (speculative decoding)
                    accepted = rows.accepted(result.next_token_ids)
                    result.accepted_lens = accepted.tolist()
                    kept_rows, kept = rows.kept(accepted)
                    if self.draft is not None:
                        self.draft.verified(batch, accepted)
                self.logits_state.record(
                    kept_rows,
                    token_ids if kept is None else token_ids.index_select(0, torch.from_numpy(kept).to(self.device)),
                )
                lasts = rows.firsts + kept_rows.lens - 1
                self.last_sampled[rows.slots[lasts]] = result.next_token_ids[lasts]
        return result

    def _pooled_step(self, batch: ForwardBatch) -> StepResult:
        """The pooling runner's step: each sampling row's pooled vector, where a token would be."""
        assert self.pooler is not None
        with torch.inference_mode():
            hidden = self.step_logits(batch)  # the pooling runner's forward: hidden states (`forward_logits`)
            assert hidden is not None
            pooled = self.pooler.head(self.model, self.pooler.pool(hidden, batch), hidden.dtype)
        return StepResult(
            step=batch.step, next_token_ids=np.zeros(pooled.shape[0], dtype=np.int32), pooled=pooled.cpu().numpy()
        )

    def _start_adapters(self, batch: ForwardBatch) -> float:
        """The step's LoRA loads and unloads, then each starting slot's adapter (on every rank); the seconds
        the loads and unloads took."""
        started = time.perf_counter()
        for update in batch.adapter_updates:
            self.update_lora_adapter(update)
        if self.lora is not None:
            for start in batch.slot_starts:
                self.lora.start(start.slot, start.adapter)
        return time.perf_counter() - started if batch.adapter_updates else 0.0

    def _apply_page_table(self, batch: ForwardBatch) -> ForwardBatch:
        """Apply the batch's page-table updates now (the draft model reads the same table); the batch
        without them, so that the forward pass does not apply them again (no other rank needs them: a
        draft model runs with one rank only, `check_config`)."""
        self.kv_cache.apply_page_table_updates(batch.page_table_slots, batch.page_table_cols, batch.page_table_pages)
        none = np.zeros(0, dtype=np.int32)
        return msgspec.structs.replace(batch, page_table_slots=none, page_table_cols=none, page_table_pages=none)

    def _fill_future_tokens(self, batch: ForwardBatch) -> ForwardBatch:
        """Feed each `FUTURE_TOKEN` input (a decode planned before its token reached the scheduler; only
        ever first in a row) the token this worker sampled last for the slot."""
        ids = batch.input_ids
        extend_lens = np.asarray(batch.extend_lens, dtype=np.int64)
        firsts = np.cumsum(extend_lens) - extend_lens
        future = ids[firsts] == FUTURE_TOKEN
        if not future.any():
            return batch
        ids = ids.copy()  # the batch's arrays are views of the scheduler's shared memory
        ids[firsts[future]] = self.last_sampled[np.asarray(batch.slots, dtype=np.int64)[future]]
        return msgspec.structs.replace(batch, input_ids=ids)

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: list[SamplingParams],
        rows: SampleRows,
        drafts: DraftDistributions | None = None,
    ) -> tuple[torch.Tensor, list[int], list[TokenLogprobs]]:
        """Adjust (penalties, bias, bans) and sample, one logit row per sampled position; logprobs from
        the logits as the model gave them. The caller counts the tokens it keeps. `drafts`: where a
        proposed token was drawn from a draft distribution, the position before it samples by rejection
        (`kernels.sampling.rejection_sample`); every other proposed token is one token for sure (prompt
        lookup, or a greedy draft), which sampling then verifies as it is (`shared.verification`)."""
        state = self.logits_state
        wanted = state.logprob_rows(rows.slots)
        row_index = torch.from_numpy(wanted).to(self.device) if wanted.shape[0] else None
        raw = None if row_index is None else torch.log_softmax(logits[row_index], dim=-1)
        state.adjust_(logits, rows)
        if drafts is None:
            token_ids = sample_batch(logits, sampling, rows.counts.tolist())
        else:
            token_ids, scores = sample_with_scores(logits, sampling, rows.counts.tolist())
            assert scores is not None  # drafts are sampled rows' only
            token_ids = self._rejection_sample(scores, rows, drafts, token_ids)
        if raw is None:
            return token_ids, [], []
        return token_ids, wanted.tolist(), state.sampled_logprobs(raw, token_ids[row_index], rows.slots[wanted])

    def _rejection_sample(
        self, scores: torch.Tensor, rows: SampleRows, drafts: DraftDistributions, token_ids: torch.Tensor
    ) -> torch.Tensor:
        """`token_ids` with the positions `drafts` names sampled by rejection against their draft
        distributions (`scores`: the filtered scores the positions were sampled from)."""
        at = drafts.positions
        index = torch.from_numpy(at).to(self.device)
        target = scores.index_select(0, index).softmax(dim=-1)
        uniform, log_noise = speculative_noise(at.shape[0], scores.shape[1], self.device)
        proposed = torch.from_numpy(rows.fed[at + 1]).to(self.device)  # a named position is never a row's last
        return token_ids.index_copy(0, index, rejection_sample(target, drafts.probs, proposed, uniform, log_noise))

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
        if self.lora is not None:  # the rows of each adapter
            self.lora.plan(batch.slots, batch.extend_lens)
        states = self.kv_cache.states
        if states is not None:  # a cached prefix's state into its slot before, a prompt's kept after
            states.restore(
                [(start.slot, start.restore_state) for start in batch.slot_starts if start.restore_state >= 0]
            )
        logits = self.forward_logits(self._rope_rows(batch), extra_rows)
        if states is not None:
            states.save(batch.state_saves)
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
        if self.pooler is not None:  # the pooling runner: every token's final hidden state (`_pooled_step`)
            return eager_hidden_states(
                self.model,
                self.attention,
                batch.slots,
                batch.prefix_lens,
                batch.extend_lens,
                batch.input_ids,
                batch.positions,
                batch.kv_locs,
            )
        if extra_rows is None and self.graph_runner and self.graph_runner.handles(batch):
            adapters = self.lora if self.lora is not None and self.lora.active else None  # their own graphs
            return self.graph_runner.forward_logits(batch, adapters)
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
