"""The parts a `ModelRunner` settles at start, beside its model and KV pool (`procs.worker.kv_pool`).

Some must come out the same on every worker rank, since each rank runs the same steps and their
collectives must agree in shape: the attention backend ("auto" resolves by what each machine has), and
whether decode steps run padded into CUDA graphs. The others follow from the model and the flags: a
pooling runner's rule, the attention kernels
over this rank's heads, and the step-cost model's window of each layer.
"""

from __future__ import annotations

import logging

import torch

from batchserve.kernels.attention import BACKENDS, AttentionBackend, create_backend, resolve_backend_name
from batchserve.kernels.kv_cache import KVCache
from batchserve.procs.worker.graph_runner import DecodeGraphRunner
from batchserve.procs.worker.kv_cache import kv_bytes_per_token
from batchserve.procs.worker.models.base import CausalLM
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec, read_model_json
from batchserve.shared.pooling import PoolerConfig, pooler_for
from batchserve.shared.step_features import layer_cost_windows

log = logging.getLogger("batchserve.worker")


def pooler_rule(spec: ModelSpec, tp: TensorParallel, runner: str, pooling: str) -> PoolerConfig | None:
    """The pooling runner's rule for this model (`shared.pooling`), logged; None for the generate runner."""
    pooler = pooler_for(spec.model_dir, spec.architecture, read_model_json(spec.model_dir), runner, pooling)
    if pooler is not None:
        if tp.world_size > 1:  # (its heads run on rank 0 alone, outside the ranks' broadcast steps)
            raise ModelLoadError("the pooling runner runs with tensor_parallel_size 1")
        log.info(
            "pooling runner: %s pooling%s%s (from %s)",
            pooler.pooling,
            ", normalised" if pooler.normalize else "",
            ", texts as a user message through the chat template" if pooler.chat is not None else "",
            pooler.source,
        )
    return pooler


def agreed_backend(name: str, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> str:
    """`name` resolved ("auto": by what this machine has), the same on every rank: each runs the same
    steps, and a backend decides whether decode steps are padded, so the collectives' shapes."""
    resolved = resolve_backend_name(name, device.type, dtype)
    if tp.world_size == 1 or resolved not in BACKENDS:
        return resolved  # an unknown name: create_backend refuses it, on every rank alike
    names = sorted(BACKENDS)
    index = names.index(resolved)
    lowest, highest = tp.min_int(index), tp.max_int(index)
    if lowest != highest:
        raise ValueError(
            f"attention_backend {name}: the worker ranks resolved it differently ({names[lowest]} "
            f"on some, {names[highest]} on others); set the same backend on every machine"
        )
    return resolved


def ring_rows_within(backend: str, step_tokens: int) -> int:
    """The most tokens a row reads through a ring: `step_tokens`, at most what `backend` reads through one
    (its `ring_row_tokens`; an unknown backend is refused later, by `create_backend`)."""
    ring_rows = BACKENDS[backend]().ring_row_tokens if backend in BACKENDS else None
    return min(step_tokens, ring_rows or step_tokens)


def attention_for(backend: str, model: CausalLM, kv_cache: KVCache) -> AttentionBackend:
    """The attention kernels `backend` names, over this rank's heads of `model` and its KV pool."""
    cfg, heads = model.config, model.heads
    return create_backend(
        backend,
        kv_cache,
        heads.num_heads,
        heads.num_kv_heads,
        cfg.head_dim,
        cfg.attention_scale,
        cfg.windows,
        cfg.attn_softcap,
        causal=not cfg.bidirectional,
    )


def cost_windows(model: CausalLM, tp: TensorParallel, dtype: torch.dtype) -> tuple[int, ...]:
    """The step-cost model's window of each layer: a linear layer's is what its state's reads cost, in keys
    (`shared.step_features.layer_cost_windows`)."""
    cfg, heads = model.config, model.heads
    return layer_cost_windows(
        cfg.windows,
        cfg.linear_layers,
        cfg.num_layers,
        0 if cfg.recurrent is None else cfg.recurrent.of_ranks(tp.world_size).bytes_per_request(dtype),
        kv_bytes_per_token(1, heads.num_kv_heads, cfg.head_dim, dtype),
    )


def decode_graph_runner(
    model: CausalLM,
    attention: AttentionBackend,
    kv_cache: KVCache,
    tp: TensorParallel,
    disable_cuda_graph: bool,
    cuda_graph_max_bs: int,
    pad_decode: bool | None,
) -> DecodeGraphRunner | None:
    """Decode batches up to cuda_graph_max_bs (0: the pool's max_running_requests) run padded on static
    buffers where they replay CUDA graphs; disable_cuda_graph: every step runs the plain eager path. Without
    graphs (CPU) padding is pure cost (the padded rows run the whole model), so decode runs unpadded
    there unless pad_decode asks for it."""
    if cuda_graph_max_bs < 0:
        raise ValueError(f"cuda_graph_max_bs must be >= 0, got {cuda_graph_max_bs}")
    padded = DecodeGraphRunner.can_capture(attention) if pad_decode is None else pad_decode
    padded = bool(tp.min_int(int(padded)))  # padding changes the collectives' shapes: all ranks or none
    if disable_cuda_graph or not padded:
        return None
    most = kv_cache.max_running_requests
    return DecodeGraphRunner(model, attention, kv_cache, max_batch_size=min(cuda_graph_max_bs or most, most))
