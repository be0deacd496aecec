"""The LoRA adapters a server loads at start (`--lora-modules`, vLLM's spelling): NAME=PATH, or vLLM's JSON
form {"name": ..., "path": ...}. Adapter i of the list is index i + 1 in every process (0: the base model):
requests carry the index (`RequestParams.adapter`), the worker's slots run it (`procs.worker.lora`)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str


def parse_lora_modules(items: list[str]) -> list[LoraModule]:
    """ValueError naming the entry for one that is neither NAME=PATH nor vLLM's JSON, or a repeated name."""
    modules = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                raw = json.loads(item)
                module = LoraModule(str(raw["name"]), str(raw["path"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules entry {item!r}: expected NAME=PATH or "
                                 f'{{"name": ..., "path": ...}}') from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entry {item!r}: expected NAME=PATH")
            module = LoraModule(name.strip(), path.strip())
        modules.append(module)
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: a name appears twice in {names}")
    return modules
