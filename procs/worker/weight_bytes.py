"""The bytes of a loaded model's weights as the worker holds them: fp32 / bf16 tensors, packed panels, GGUF
blocks (a GGUF file's read through `mmap`: the file's pages), each storage counted once however many layers
share it (a tied LM head, fused views). What `/metrics` reports as `batchserve_model_weight_bytes`."""

from __future__ import annotations

from typing import Any

import torch

_LEAVES = (str, bytes, int, float, bool, type(None))


def weight_bytes(model: Any) -> int:
    """Bytes of every distinct tensor storage reachable from `model`'s attributes (lists, tuples, dicts,
    dataclasses and plain objects, walked once each)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [model]
    while stack:
        item = stack.pop()
        if isinstance(item, _LEAVES) or id(item) in seen_objects or callable(item) and not hasattr(item, "__dict__"):
            continue
        seen_objects.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.is_mkldnn:  # oneDNN's packed layout (no CPU C kernels): an opaque tensor, no storage to share
                storages[id(item)] = item.numel() * item.element_size()
            elif item.device.type != "meta":
                storage = item.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif hasattr(item, "__dict__") or hasattr(item, "__slots__"):
            stack.extend(_attributes(item))
    return sum(storages.values())


def _attributes(item: Any) -> list[Any]:
    values = list(vars(item).values()) if hasattr(item, "__dict__") else []
    for name in getattr(type(item), "__slots__", ()):
        values.append(getattr(item, name, None))
    return [v for v in values if not isinstance(v, torch.nn.Module | type)]
