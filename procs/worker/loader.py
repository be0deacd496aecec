"""Loading the model in the worker: `load_model_config` (the architecture's reading of config.json),
`load_model` (the model from its checkpoint's tensors: `iter_checkpoint`). Finding the model and its
metadata every process shares (architecture, context length, EOS ids) is `shared.model.ModelSpec`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from batchserve.procs.worker.gguf_tensors import has_block_tensors, iter_block_tensors
from batchserve.procs.worker.hf_quantized import quantized_tensors
from batchserve.procs.worker.models import ARCHITECTURES, model_class
from batchserve.procs.worker.models.base import CausalLM, ModelConfig, Weight
from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.model import ModelLoadError, ModelSpec, read_model_json

__all__ = ["iter_checkpoint", "iter_safetensors", "load_model", "load_model_config"]


def load_model_config(spec: ModelSpec) -> ModelConfig:
    """The model's config as its architecture reads it; ModelLoadError for an architecture or a config
    this code cannot run (one that lives in the checkpoint's own code, `auto_map`, named as such)."""
    raw = read_model_json(spec.model_dir)
    if raw.get("auto_map") and spec.architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"{spec.architecture or 'this model'} is defined by code in its own folder (config.json's "
            f"auto_map, transformers' trust_remote_code), which this server does not run"
        )
    return model_class(spec.architecture).config_from_hf(raw, spec)


def load_model(
    spec: ModelSpec,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    tp: TensorParallel | None = None,
    lm_head: bool = True,
) -> CausalLM:
    """The model (`tp`'s rank's share of it) from its checkpoint, for requests up to `spec.context_length`
    tokens; without `lm_head`, the decoder alone (the pooling runner's)."""
    config = load_model_config(spec)
    quantization = "none" if quantization == "auto" else quantization  # auto: blocks stay as the file has them
    # transformers' older checkpoints carry rotary tables, which the model computes itself
    tensors = ((n, t) for n, t in iter_checkpoint(spec.model_dir) if not n.endswith("rotary_emb.inv_freq"))
    if not lm_head:
        config = dataclasses.replace(config, lm_head=False)
    return model_class(spec.architecture).from_tensors(
        config,
        tensors,
        max_positions=spec.context_length,
        dtype=dtype,
        device=device,
        quantization=quantization,
        tp=tp or TensorParallel(),
    )


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, Weight]]:
    """Every tensor of the folder: its safetensors' (a quantized folder's linear layers as blocks built from
    them, `procs.worker.hf_quantized`) and, for a GGUF file's folder, the blocks kept in the file (each read as
    fp32 by whatever does not keep blocks: `WeightTaker`)."""
    yield from quantized_tensors(model_dir, iter_safetensors(model_dir))
    if has_block_tensors(model_dir):
        yield from iter_block_tensors(model_dir)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, Weight]]:
    """Yield (name, slice) for every tensor of every *.safetensors file in the folder: a slice reads
    from the file only what is indexed of it, so a tensor-parallel rank reads its share alone."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_slice(name)
