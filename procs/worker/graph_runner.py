"""Decode steps on static, padded buffers: CUDA-graph replay on CUDA; eagerly elsewhere, when asked.

A decode batch of b requests runs at the smallest captured size s >= b (sizes 1, 2, 4, 8, then every
8 up to the largest, which is always included). Its ids, positions and KV locations are copied into
static buffers; rows b..s-1 are padding (token 0 at position 0, K/V written into the dummy page 0,
attending to the dummy page only), and only the real rows' logits are returned.

On CUDA with a `CudaGraphAttentionBackend` (flashinfer) one graph per size is captured at start and
replayed after the backend rewrites its static plan buffers. Elsewhere (CPU, or the torch backend,
whose per-step plan is not capturable) nothing is captured and the padded buffers run through the
model eagerly; only the real rows get the LM head. `ModelRunner` takes this path there only when
asked (`pad_decode=True`, as the tests do to check the padding logic on CPU): without replay,
padding is pure cost.

A step with LoRA adapter rows runs a second set of graphs, captured with the adapters' stacked pairs
(`procs.worker.lora.slots`): the rows' adapter mask is an input, copied into a static buffer whose padding
rows are 0 (no adapter). The set is captured at the first such step after an adapter load or unload
(the pairs are restacked then), so the base model's graphs, captured at start, stay as they are. That
step takes the capture's time too (`StepResult.setup_s`, which the step-cost fit leaves out); a server
that swaps adapters often (`--max-cpu-loras` below the adapters in use) captures at every swap.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TypeGuard

import numpy as np
import torch

from batchserve.kernels.attention import AttentionBackend, AttentionMetadata, CudaGraphAttentionBackend, plan_step
from batchserve.kernels.kv_cache import KVCache
from batchserve.procs.worker.lora.slots import LoraSlots
from batchserve.procs.worker.models.base import CausalLM
from batchserve.shared.messages import ForwardBatch

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8, up to and including `max_batch_size` (so every size has a bucket)."""
    if max_batch_size < 1:
        raise ValueError(f"max batch size for CUDA graphs must be >= 1, got {max_batch_size}")
    sizes = {s for s in SMALL_SIZES if s <= max_batch_size}
    sizes.update(range(SMALL_SIZES[-1] + SIZE_STEP, max_batch_size + 1, SIZE_STEP))
    sizes.add(max_batch_size)
    return sorted(sizes)


class DecodeGraphRunner:
    """Runs decode-only batches of up to `max_batch_size` requests padded to a captured size."""

    def __init__(self, model: CausalLM, attention: AttentionBackend, kv_cache: KVCache, *, max_batch_size: int):
        self.model = model
        self.attention = attention
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.batch_sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        size = self.max_batch_size
        # rows: input ids, positions, kv_locs; zeros are exactly the padding values
        self._inputs = torch.zeros((3, size), dtype=torch.int64, device=self.device)
        pinned = self.device.type == "cuda"
        self._staging = self._inputs if not pinned else torch.zeros((3, size), dtype=torch.int64, pin_memory=True)
        self._staging_np = self._staging.numpy()
        # set once the last host-to-device copy out of the (pinned) staging buffer has completed
        self._staged_copy = torch.cuda.Event() if pinned else None
        self._rows = torch.arange(size, dtype=torch.int64, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_logits: dict[int, torch.Tensor] = {}
        # the graphs of steps with adapter rows, captured at the adapters' version `_lora_version`
        self._lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._lora_logits: dict[int, torch.Tensor] = {}
        self._lora_version = -1
        self.steps_per_size: Counter[int] = Counter()  # padded steps run, by padded size
        self.lora_steps = 0  # padded steps with adapter rows
        self.lora_captures = 0  # captures of the adapter graphs (one after each adapter load or unload in use)
        self.adapters: LoraSlots | None = None  # the LoRA slots, once enabled (`procs.worker.lora.step`)
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory taken by capture (torch.cuda.mem_get_info before/after)
        if self.can_capture(attention):
            attention.init_cuda_graphs(self.batch_sizes)
            self._capture(self._graphs, self._graph_logits)

    @staticmethod
    def can_capture(attention: AttentionBackend) -> TypeGuard[CudaGraphAttentionBackend]:
        """Whether decode steps on this backend's device can be captured as CUDA graphs."""
        return attention.kv_cache.device.type == "cuda" and isinstance(attention, CudaGraphAttentionBackend)

    @property
    def uses_cuda_graphs(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, batch_size: int) -> int:
        """The smallest captured size >= batch_size."""
        for size in self.batch_sizes:
            if size >= batch_size:
                return size
        raise ValueError(f"batch of {batch_size} exceeds the largest captured size {self.max_batch_size}")

    def handles(self, batch: ForwardBatch) -> bool:
        """Batches of one token per row, each after a cached prefix (decode rows of width 1; a row may
        be a one-token prefill chunk), up to the largest size: graphs are captured for one token per
        row. Prefill, wider decode rows and larger batches run eagerly, as does a step whose rope rows were
        computed for it (a one-token chunk of a long prompt under dynamic NTK)."""
        return (
            batch.num_requests <= self.max_batch_size
            and max(batch.extend_lens) == 1
            and min(batch.prefix_lens) > 0
            and not self.model.rope.has_step_rows
        )

    # -- one step ---------------------------------------------------------------------------------

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        """float32 logits of the batch's sampling rows, one position each (page table already applied; where
        the step has adapter rows, their mask planned for its n rows)."""
        n = batch.num_requests
        size = self.bucket_for(n)
        if self._staged_copy is not None:
            self._staged_copy.synchronize()  # don't overwrite a buffer an async copy may still read
        staged = self._staging_np
        staged[0, :n] = batch.input_ids
        staged[1, :n] = batch.positions
        staged[2, :n] = batch.kv_locs
        staged[:, n:size] = 0
        if self._staged_copy is not None:  # staged in pinned host memory (else `_staging` is `_inputs`)
            self._inputs[:, :size].copy_(self._staging[:, :size], non_blocking=True)
            self._staged_copy.record()
        padding = size - n
        metadata = AttentionMetadata(
            slots=list(batch.slots) + [0] * padding,
            prefix_lens=list(batch.prefix_lens) + [0] * padding,
            extend_lens=[1] * size,
            kv_locs=self._inputs[2, :size],
            num_padding=padding,
        )
        self.steps_per_size[size] += 1
        graphs, outputs = self._graphs, self._graph_logits
        lora = self.adapters if self.adapters is not None and self.adapters.active else None
        if lora is not None:
            graphs, outputs = self._lora_graphs_for(lora)
            lora.pad_rows(lora.row_adapter, size, self.max_batch_size)
            self.lora_steps += 1
        samples = np.asarray(batch.sample_lens, dtype=bool)
        if not samples.any():
            self._run_eager(metadata, size, None)
            return None
        rows = self._rows[:n] if samples.all() else torch.from_numpy(np.flatnonzero(samples)).to(self.device)
        graph = graphs.get(size)
        if graph is None:
            return self._run_eager(metadata, size, rows)
        plan_step(self.attention, metadata, graph=True)
        graph.replay()
        return outputs[size][rows]  # a copy: the static output is overwritten by the next replay

    def _lora_graphs_for(self, lora: LoraSlots) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
        """The graphs of steps with adapter rows at the adapters' current version: captured anew (the old
        ones released) after a load or an unload; none where nothing is captured (CPU)."""
        if self._graphs and self._lora_version != lora.version:
            # the step's own inputs, kept while the capture runs all-padding rows (the dummy page only)
            inputs = self._inputs.clone()
            self._inputs.zero_()
            self._lora_graphs, self._lora_logits = {}, {}
            self._capture(self._lora_graphs, self._lora_logits, lora)
            self._inputs.copy_(inputs)
            self._lora_version = lora.version
            self.lora_captures += 1
        return self._lora_graphs, self._lora_logits

    def _run_eager(self, metadata: AttentionMetadata, size: int, rows: torch.Tensor | None) -> torch.Tensor | None:
        plan_step(self.attention, metadata)
        return self._forward_static(size, rows)

    def _forward_static(self, size: int, rows: torch.Tensor | None) -> torch.Tensor | None:
        return self.model.forward(self._inputs[0, :size], self._inputs[1, :size], self.attention, rows)

    # -- capture ----------------------------------------------------------------------------------

    def _padding_metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slots=[0] * size,
            prefix_lens=[0] * size,
            extend_lens=[1] * size,
            kv_locs=self._inputs[2, :size],
            num_padding=size,
        )

    def _capture(
        self, graphs: dict[int, torch.cuda.CUDAGraph], outputs: dict[int, torch.Tensor], lora: LoraSlots | None = None
    ) -> None:
        """Capture one graph per size into `graphs` (their logits into `outputs`), largest first so the smaller
        ones reuse its memory pool. Warm-up and capture run all-padding batches: they touch only the dummy
        page (and with `lora`, an all-0 mask: no adapter row)."""
        attention = self.attention
        assert isinstance(attention, CudaGraphAttentionBackend)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):
                rows = self._rows[:size]
                if lora is not None:
                    lora.pad_rows(None, size, self.max_batch_size)
                plan_step(attention, self._padding_metadata(size), graph=True)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: lazy initialisation and autotuning stay out of the graph
                        self._forward_static(size, rows)
                torch.cuda.current_stream(self.device).wait_stream(side)
                if lora is not None:  # after the warm-up: a mask it derived (`mask_of`) is derived in the graph
                    lora.pad_rows(None, size, self.max_batch_size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward_static(size, rows)
                assert logits is not None  # every row's were asked
                graphs[size] = graph
                outputs[size] = logits
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - start
        self.capture_bytes += free_before - torch.cuda.mem_get_info(self.device)[0]
