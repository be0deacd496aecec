"""The worker's KV pool for a loaded model (`kernels.kv_cache.KVCache`), as `ModelRunner` builds it at start.

Rings for the sliding layers where they apply (rows of at most `ring_step_tokens` read through them, no
draft model reading the KV whole; `procs.worker.kv_cache.ring_layers`), a hybrid model's per-slot recurrent
states, and pages for the other layers (and the draft's) for a token capacity, or as many as the memory
budget left after the rings and states holds. Each rank sizes its pool from its own memory; all take the
smallest, which the scheduler plans with. The arithmetic of pages and budgets is `procs.worker.kv_cache`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from batchserve.kernels.kv_cache import KVCache
from batchserve.kernels.recurrent_state import RecurrentStatePool
from batchserve.procs.worker.kv_cache import GIB, kv_bytes_per_token, num_pages_for, ring_layers, ring_pages_for
from batchserve.procs.worker.models.base import CausalLM, ModelConfig
from batchserve.procs.worker.parallel import TensorParallel


class Rings(NamedTuple):
    """The layers that keep their KV in rings, the widest of their windows, and each slot's ring's pages."""

    layers: tuple[int, ...]
    window: int
    pages: int


NO_RINGS = Rings((), 0, 0)


def rings_for(config: ModelConfig, step_tokens: int, page_size: int, max_context: int) -> Rings:
    """The rings of a model whose rows take at most `step_tokens` tokens after their first (0: no rings);
    none where a ring would hold the whole context (no gain)."""
    layers = ring_layers(config.windows, step_tokens)
    if not layers:
        return NO_RINGS
    window = max(config.windows[layer] for layer in layers)
    pages = ring_pages_for(window, step_tokens, page_size)
    return NO_RINGS if pages * page_size >= max_context else Rings(layers, window, pages)


def recurrent_states(
    config: ModelConfig,
    tp: TensorParallel,
    max_running: int,
    dtype: torch.dtype,
    device: torch.device,
    snapshots: int,
) -> RecurrentStatePool | None:
    """A hybrid model's states of its linear layers, this rank's share, one per request slot (and
    `snapshots` kept for the prefix cache); None for a model without linear layers."""
    if config.recurrent is None:
        return None
    return RecurrentStatePool(
        num_layers=len(config.linear_layers),
        shape=config.recurrent.of_ranks(tp.world_size),
        max_running_requests=max_running,
        dtype=dtype,
        device=device,
        snapshots=snapshots,
    )


def build_kv_pool(
    model: CausalLM,
    draft: CausalLM | None,
    *,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    max_context: int,
    page_size: int,
    capacity_tokens: int,
    budget_gb: Callable[[], float],
    max_running: int,
    ring_step_tokens: int,
    state_snapshots: int,
) -> KVCache:
    """`model`'s KV pool (see the module's docstring), its pages shared with `draft`'s layers: for
    `capacity_tokens` (> 0), else for `budget_gb()` GiB (asked once the states are allocated) less what
    the rings and states take."""
    cfg, heads = model.config, model.heads
    rings = rings_for(cfg, ring_step_tokens if draft is None else 0, page_size, max_context)
    layer_bytes = kv_bytes_per_token(1, heads.num_kv_heads, cfg.head_dim, dtype)
    kv_layers = len(cfg.kv_layers)
    bytes_per_token = layer_bytes * (kv_layers - len(rings.layers)) or layer_bytes
    if draft is not None:
        bytes_per_token += kv_bytes_per_token(
            draft.config.num_layers, draft.heads.num_kv_heads, draft.config.head_dim, dtype
        )
    states = recurrent_states(cfg, tp, max_running, dtype, device, state_snapshots)
    fixed_gb = layer_bytes * len(rings.layers) * (1 + max_running * rings.pages) * page_size / GIB
    fixed_gb += 0 if states is None else states.memory_bytes / GIB
    budget = 0.0 if capacity_tokens > 0 else budget_gb() - fixed_gb
    if capacity_tokens <= 0 and budget <= 0:
        raise ValueError(
            f"the sliding layers' rings and the recurrent states take {fixed_gb:.2f} GiB of KV "
            f"memory, the whole budget: lower --max-running-requests or raise --kv-memory-gb"
        )
    num_pages = tp.min_int(
        num_pages_for(page_size, capacity_tokens=capacity_tokens, memory_gb=budget, bytes_per_token=bytes_per_token)
    )
    return KVCache(
        num_layers=kv_layers,
        num_kv_heads=heads.num_kv_heads,
        head_dim=cfg.head_dim,
        page_size=page_size,
        num_pages=num_pages,
        max_running_requests=max_running,
        max_pages_per_request=-(-max_context // page_size),
        dtype=dtype,
        device=device,
        ring_layers=rings.layers,
        ring_pages=rings.pages,
        ring_window=rings.window,
        states=states,
    )
