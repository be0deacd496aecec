"""The CUDA path's Triton kernels: batchserve's own (`lora`: multi-LoRA's shrink / expand over rows grouped
by adapter) and flash-linear-attention's (`gated_delta`: Gated DeltaNet's chunked and recurrent forms).

They are chosen by the `triton_kernels` setting, not by the device: "auto" runs them on a CUDA device where
triton imports; "on" runs them wherever they are asked, so the same code path runs on CPU tensors under
Triton's interpreter (`TRITON_INTERPRET=1` set before triton is imported: the tests do). Each launch is
counted in `LAUNCHES` (by kernel family), so a test can tell that the kernels ran instead of torch.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import torch

CHOICES = ("auto", "on", "off")
LAUNCHES: Counter[str] = Counter()  # kernel family -> launches in this process
_enabled = False


def available() -> bool:
    """Whether triton and flash-linear-attention are installed (the `gpu` extra; the `triton` extra for the
    interpreter tests)."""
    return all(importlib.util.find_spec(name) is not None for name in ("triton", "fla"))


def select(setting: str, device: torch.device) -> bool:
    """Turn the Triton kernels on or off for this process by `setting` (one of CHOICES) and `device`; what
    it came to. "on" without triton installed is refused in one line."""
    global _enabled
    if setting not in CHOICES:
        raise ValueError(f"triton_kernels must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "on" and not available():
        raise ValueError("triton_kernels on: triton or fla-core is not installed (pip install 'batchserve[gpu]')")
    _enabled = setting == "on" or (setting == "auto" and device.type == "cuda" and available())
    return _enabled


def enabled() -> bool:
    return _enabled
