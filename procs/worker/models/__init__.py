"""Model architectures: `ARCHITECTURES` maps each name of `shared.model.SUPPORTED_ARCHITECTURES` (the
one list, which every process can check a config against) to the class that runs it.

The classes are imported on first use, so that the loader can check a config against this list
without importing the models (which import the loader for `ModelConfig`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from shared.model import SUPPORTED_ARCHITECTURES

if TYPE_CHECKING:
    from procs.worker.models.llama import LlamaModel


def _llama() -> type[LlamaModel]:
    from procs.worker.models.llama import LlamaModel

    return LlamaModel


# The registry: architecture name -> loader of the model class (Qwen2/Qwen3 are Llama with a qkv
# bias / a q-k norm, which `LlamaModel` reads from the config).
ARCHITECTURES: dict[str, Callable[[], type[LlamaModel]]] = {
    "LlamaForCausalLM": _llama, "Qwen2ForCausalLM": _llama, "Qwen3ForCausalLM": _llama}
assert tuple(ARCHITECTURES) == SUPPORTED_ARCHITECTURES, "a supported architecture without its class, or the reverse"


def model_class(architecture: str) -> type[LlamaModel]:
    """The class that runs `architecture`; ValueError naming the supported ones if there is none."""
    loader = ARCHITECTURES.get(architecture)
    if loader is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return loader()


__all__ = ["ARCHITECTURES", "model_class"]
