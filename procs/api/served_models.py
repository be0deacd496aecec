"""What a request may name in `model`: the served model, or one of its LoRA adapters (`--lora-modules`, and
those loaded at run time: vLLM's and OpenAI's fine-tune convention), and what `/v1/models` lists."""

from __future__ import annotations

from typing import Any

from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.lora import parse_lora_modules


class ServedModels:
    def __init__(self, base: str, adapters: tuple[str, ...] = ()) -> None:
        """`adapters`: adapter i + 1's name (`shared.lora`)."""
        self.base = base
        self.adapters: dict[str, int] = {name: i for i, name in enumerate(adapters, 1)}  # name -> index, loaded ones
        self.names: dict[int, str] = {i: name for name, i in self.adapters.items()}  # every index ever (metrics)
        self.next_index = len(adapters) + 1  # a runtime load's: indices are never reused

    @classmethod
    def of(cls, base: str, config: ServerConfig) -> ServedModels:
        """ValueError for an adapter named as the base model (a request could not tell them apart)."""
        names = tuple(m.name for m in parse_lora_modules(config.lora_modules)) if config.enable_lora else ()
        if base in names:
            raise ValueError(f"lora_modules: the adapter name {base!r} is the served model's name")
        return cls(base, names)

    def adapter(self, model: str | None) -> int:
        """The adapter a request's `model` names: 0 (absent, or the base model), else its index; an unknown
        (or unloaded) name is 404 model_not_found, as OpenAI answers it."""
        if model is None or model == self.base:
            return 0
        if model in self.adapters:
            return self.adapters[model]
        served = ", ".join(f"`{name}`" for name in (self.base, *self.adapters))
        raise Refusal(
            f"The model `{model}` does not exist; this server serves {served}.",
            "model",
            status=404,
            code="model_not_found",
        )

    def name(self, adapter: int) -> str:
        return self.names[adapter] if adapter else self.base

    def check_free(self, name: str) -> None:
        """Refusal (400) when `name` is taken: an adapter's, or the served model's."""
        if name in self.adapters:
            raise Refusal(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name == self.base or not name:
            raise Refusal(
                f"lora_name {name!r} cannot name an adapter: it is {'empty' if not name else 'the served model'}",
                "lora_name",
            )

    def load(self, name: str) -> int:
        """A new adapter's index (Refusal: the name is taken)."""
        self.check_free(name)
        index, self.next_index = self.next_index, self.next_index + 1
        self.adapters[name], self.names[index] = index, name
        return index

    def unload(self, name: str) -> int:
        """The index the name had (Refusal 404: no adapter of that name is loaded)."""
        if name not in self.adapters:
            raise Refusal(
                f"The lora adapter '{name}' cannot be found.", "lora_name", status=404, code="model_not_found"
            )
        return self.adapters.pop(name)

    def cards(self, created: int, max_context: int) -> list[dict[str, Any]]:
        base = {
            "id": self.base,
            "object": "model",
            "created": created,
            "owned_by": "batchserve",
            "max_model_len": max_context,
        }
        return [base, *({**base, "id": name, "parent": self.base, "root": name} for name in self.adapters)]
