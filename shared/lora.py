"""LoRA adapters as every process names them: the ones a server loads at start (`--lora-modules`, vLLM's
spelling: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}), adapter i of the list being index
i + 1 in every process (0: the base model; one loaded at run time takes the next index never used, so a
name loaded again is a new index: its cached KV is not the old weights'); requests carry the index
(`RequestParams.adapter`), the worker's slots run it (`procs.worker.lora.slots`). What a PEFT folder must be to
be served (`AdapterConfig`, `check_adapter`) is read here, by the worker at load and by the api before a
runtime load."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from batchserve.shared.errors import ModelLoadError


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str


def held_at_start(modules: list[LoraModule], max_cpu_loras: int) -> list[LoraModule]:
    """The adapters the worker loads at start (the first `max_cpu_loras`; 0: all), which the scheduler counts
    as held (`procs.scheduler.lora.adapter_updates`): the others load when a request needs them."""
    return modules[: max_cpu_loras or None]


def parse_lora_modules(items: list[str]) -> list[LoraModule]:
    """ValueError naming the entry for one that is neither NAME=PATH nor vLLM's JSON, or a repeated name."""
    modules = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                raw = json.loads(item)
                module = LoraModule(str(raw["name"]), str(raw["path"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f'lora_modules entry {item!r}: expected NAME=PATH or {{"name": ..., "path": ...}}'
                ) from None
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


# PEFT's module names -> (the fused projection of our layer that holds it, its part in the fusion)
PROJECTIONS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
PREFIX = "base_model.model.model.layers."
# an adapter trained on a multimodal checkpoint's text model (Qwen3.5's released ones): its decoder's layers
MULTIMODAL_PREFIX = "base_model.model.model.language_model.layers."
ATTENTION_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's count of a model's experts


def served_projections(raw_config: dict) -> frozenset[str]:
    """The PEFT modules whose adapters this server runs on a model (its config.json, or its `text_config`): a
    dense decoder's seven projections; a mixture of experts' attention projections alone (LoRA on its experts
    is not served). A hybrid model's linear-attention layers have none of them: its adapters run on its full
    layers' attention and its MLPs."""
    raw_config = raw_config.get("text_config") or raw_config
    experts = any(int(raw_config.get(key) or 0) > 0 for key in EXPERT_KEYS)
    return ATTENTION_PROJECTIONS if experts else frozenset(PROJECTIONS)


def tensor_name(name: str) -> str:
    """A tensor of adapter_model.safetensors under the name of a text decoder's (a multimodal checkpoint's
    language model renamed, as the model's own weights are)."""
    return PREFIX + name[len(MULTIMODAL_PREFIX) :] if name.startswith(MULTIMODAL_PREFIX) else name


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    targets: frozenset[str]  # of PROJECTIONS

    @classmethod
    def read(cls, folder: Path, max_rank: int, served: frozenset[str] = frozenset(PROJECTIONS)) -> AdapterConfig:
        """`adapter_config.json` of `folder`; ModelLoadError naming what this server does not run (targets
        outside `served`, the model's `served_projections`, among them)."""
        path = folder / "adapter_config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"LoRA adapter {folder}: cannot read adapter_config.json ({exc})") from None

        def refuse(field: str, why: str) -> ModelLoadError:
            return ModelLoadError(f"LoRA adapter {path}: {field} {why}")

        if raw.get("peft_type", "LORA") != "LORA":
            raise refuse("peft_type", f"{raw['peft_type']!r} is not served (LORA is)")
        for field in (
            "modules_to_save",
            "rank_pattern",
            "alpha_pattern",
            "target_parameters",
            "layers_to_transform",
            "layer_replication",
        ):
            if raw.get(field):
                raise refuse(field, f"{raw[field]!r} is not served (adapters of the seven projections only)")
        if raw.get("use_dora"):
            raise refuse("use_dora", "true (DoRA) is not served")
        if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
            raise refuse("bias", f"{raw.get('bias')!r} is not served (none is)")
        targets = raw.get("target_modules") or []
        if isinstance(targets, str) or set(targets) - set(PROJECTIONS):
            raise refuse(
                "target_modules",
                f"{targets!r}: only {', '.join(PROJECTIONS)} are served "
                f"(not lm_head, embeddings or a regular expression)",
            )
        if set(targets) - served:
            raise refuse(
                "target_modules",
                f"{sorted(set(targets) - served)}: this model's MLPs are mixtures of experts, "
                f"whose LoRA is not served (adapters of {', '.join(sorted(served))} are)",
            )
        rank = int(raw["r"])
        if not 1 <= rank <= max_rank:
            raise refuse("r", f"{rank} is above --max-lora-rank {max_rank}")
        alpha = float(raw.get("lora_alpha", rank))
        return cls(rank, alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank), frozenset(targets))


def check_adapter(folder: str | Path, max_rank: int, served: frozenset[str] = frozenset(PROJECTIONS)) -> AdapterConfig:
    """A PEFT folder's config and its tensors' names (the safetensors header alone: the api checks a folder
    before a runtime load without reading its weights); ModelLoadError naming what is not served."""
    from safetensors import safe_open

    folder = Path(folder)
    config = AdapterConfig.read(folder, max_rank, served)
    try:
        with safe_open(str(folder / "adapter_model.safetensors"), framework="numpy") as weights:
            names = list(weights.keys())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"LoRA adapter {folder}: cannot read adapter_model.safetensors ({exc})") from None
    modules = "|".join(sorted(config.targets))
    pattern = re.compile(rf"{re.escape(PREFIX)}\d+\.(self_attn|mlp)\.({modules})\.lora_[AB]\.weight")
    unserved = sorted(name for name in names if not pattern.fullmatch(tensor_name(name)))
    if unserved or not names:
        raise ModelLoadError(
            f"LoRA adapter {folder}: tensors of no served projection: {', '.join(unserved[:3])}"
            if unserved
            else f"LoRA adapter {folder}: adapter_model.safetensors holds no tensors"
        )
    return config
