"""What a request may name in `model`: the served model, or one of its LoRA adapters (`--lora-modules`,
vLLM's and OpenAI's fine-tune convention), and what `/v1/models` lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.config import ServerConfig
from shared.errors import Refusal
from shared.lora import parse_lora_modules


@dataclass(frozen=True)
class ServedModels:
    base: str
    adapters: tuple[str, ...] = ()  # adapter i + 1's name (`shared.lora`)

    @classmethod
    def of(cls, base: str, config: ServerConfig) -> ServedModels:
        """ValueError for an adapter named as the base model (a request could not tell them apart)."""
        names = tuple(m.name for m in parse_lora_modules(config.lora_modules)) if config.enable_lora else ()
        if base in names:
            raise ValueError(f"lora_modules: the adapter name {base!r} is the served model's name")
        return cls(base, names)

    def adapter(self, model: str | None) -> int:
        """The adapter a request's `model` names: 0 (absent, or the base model), i + 1 for adapter i; else
        404 model_not_found, as OpenAI answers it."""
        if model is None or model == self.base:
            return 0
        if model in self.adapters:
            return self.adapters.index(model) + 1
        served = ", ".join(f"`{name}`" for name in (self.base, *self.adapters))
        raise Refusal(f"The model `{model}` does not exist; this server serves {served}.", "model", status=404,
                      code="model_not_found")

    def name(self, adapter: int) -> str:
        return self.adapters[adapter - 1] if adapter else self.base

    def cards(self, created: int, max_context: int) -> list[dict[str, Any]]:
        base = {"id": self.base, "object": "model", "created": created, "owned_by": "batchserve",
                "max_model_len": max_context}
        return [base, *({**base, "id": name, "parent": self.base, "root": name} for name in self.adapters)]
