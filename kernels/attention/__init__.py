"""Attention backends behind one interface (`plan` per step, `forward` per layer), chosen by name
from `BACKENDS`, the one list of them (or by "auto", see `resolve_backend_name`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from batchserve.kernels.attention.base import AttentionBackend, AttentionMetadata, CudaGraphAttentionBackend, plan_step

if TYPE_CHECKING:
    from batchserve.kernels.kv_cache import KVCache


def _torch_backend() -> type[AttentionBackend]:
    from batchserve.kernels.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


def _cpu_backend() -> type[AttentionBackend]:
    from batchserve.kernels.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend


def _flashinfer_backend() -> type[AttentionBackend]:
    """Raises `FlashInferUnavailable` (an ImportError and a ValueError) where flashinfer is missing."""
    from batchserve.kernels.attention.flashinfer import FlashInferAttentionBackend, import_flashinfer

    import_flashinfer()
    return FlashInferAttentionBackend


# The registry: name -> loader of the backend class (imported lazily: a CUDA backend must not be
# imported on CPU).
BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "cpu": _cpu_backend,
    "flashinfer": _flashinfer_backend,
    "torch": _torch_backend,
}


def resolve_backend_name(name: str, device_type: str, dtype: torch.dtype | None = None) -> str:
    """`auto` picks flashinfer on CUDA (at 16-bit dtypes) when it is importable, cpu for float32 on
    the CPU where the C kernels build, torch otherwise; any other name is returned as it is."""
    if name != "auto":
        return name
    if device_type == "cpu" and dtype in (None, torch.float32):
        from batchserve.kernels import native

        if native.available():
            return "cpu"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return "torch"
    if device_type == "cuda":
        try:
            BACKENDS["flashinfer"]()
            return "flashinfer"
        except ImportError:
            pass
    return "torch"


def create_backend(
    name: str,
    kv_cache: KVCache,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    windows: Sequence[int] = (),
    softcap: float = 0.0,
    causal: bool = True,
) -> AttentionBackend:
    """The backend `name` (or auto's pick); `windows`: each layer's sliding window, 0 for none (all 0 if
    empty); `softcap`: attention scores soft-capped (0: not); `causal` False: an encoder's attention."""
    name = resolve_backend_name(name, kv_cache.device.type, kv_cache.dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]()(kv_cache, num_heads, num_kv_heads, head_dim, scale, windows, softcap, causal)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKENDS",
    "CudaGraphAttentionBackend",
    "create_backend",
    "plan_step",
    "resolve_backend_name",
]
