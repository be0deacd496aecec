"""The worker's device, dtype and quantization, resolved from what the config says ("auto" included) and
checked once, before any weight loads."""

from __future__ import annotations

import torch

from batchserve.kernels import native
from batchserve.shared.config import QUANTIZATIONS

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (the CPU has no fast bf16 matmul), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")
    on_cpu_kernels = device.type == "cpu" and dtype == torch.float32 and native.available()
    if quantization not in ("auto", "none") and not on_cpu_kernels:  # int8 panels, GGUF blocks: C kernels
        raise ValueError(
            f"quantization {quantization} runs on the CPU at dtype float32, with the C kernels (here: "
            f"{device.type}, {dtype}, C kernels {'built' if native.available() else 'unavailable'})"
        )
