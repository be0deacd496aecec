"""A GGUF file as a Hugging Face folder the processes read: config.json, the tokenizer and the generation
config through transformers' GGUF reader, and the weights in two parts:
- the tensors whose blocks the CPU kernels multiply as they are (`BLOCK_TENSORS`: 2-D Q8_0, Q4_0, ..., Q6_K,
  MXFP4), listed in `gguf_blocks.json` by their Hugging Face name and read by the worker from the GGUF
  file itself through `mmap` (`procs.worker.gguf_tensors`): nothing copied, no fp32 image of the model;
  a split model's tensors from each of its shards (`shared.gguf_shards`);
- the rest (norms, biases, F16 / F32 tensors, block types without a kernel) de-quantized into
  `model.safetensors` as transformers loads them (its per-architecture tensor processing included).
Where transformers' processing of an architecture does more than reorder a block tensor's rows (the
Llama family's q / k rows, which the manifest records as `heads`), every tensor is de-quantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchserve.shared.errors import ModelLoadError
from batchserve.shared.gguf_shards import gguf_shards

MANIFEST = "gguf_blocks.json"
BLOCK_TENSORS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")  # kernels.quant_blocks

# GGUF metadata that transformers' GGUF loader does not read into the config (it takes the config class's
# default instead, right only for the checkpoint that default came from): llama.cpp key under the
# architecture's prefix -> config field, by GGUF architecture.
GGUF_FIELDS_TRANSFORMERS_MISSES = {
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}


def gguf_architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field else ""


def gguf_config_fields(gguf_path: Path) -> dict[str, Any]:
    """The config fields of `GGUF_FIELDS_TRANSFORMERS_MISSES` that this file's metadata holds."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch, out = gguf_architecture(reader), {}
    for key, name in GGUF_FIELDS_TRANSFORMERS_MISSES.get(arch, {}).items():
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            out[name] = int(field.parts[field.data[0]][0])
    return out


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write `gguf`'s config.json, tokenizer, generation config, block manifest and other tensors to `out_dir`
    (`gguf`: a file, or a split model's first shard, which holds the metadata)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, **gguf_config_fields(gguf))
        with torch.device("meta"):  # the names and shapes of the model's tensors, none of their memory
            model = AutoModelForCausalLM.from_config(config)
        _write_tensors(gguf, model, out_dir)
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers raises many kinds for unsupported GGUF contents
        raise ModelLoadError(f"cannot read GGUF {gguf}: {exc}") from exc
    raw = model.config.to_dict()
    raw.pop("quantization_config", None)
    raw["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, default=str))
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _write_tensors(gguf: Path, model: Any, out_dir: Path) -> None:
    """model.safetensors (what stays fp32) and `MANIFEST` (what stays in blocks), by Hugging Face name."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    shards = gguf_shards(gguf)
    readers = [GGUFReader(str(shard)) for shard in shards]
    tensors = [(i, tensor) for i, reader in enumerate(readers) for tensor in reader.tensors]
    processor_class = TENSOR_PROCESSORS.get(gguf_architecture(readers[0]), TensorProcessor)
    processor = processor_class(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    keeps_blocks = processor_class in (TensorProcessor, LlamaTensorProcessor)
    # llama.cpp's converter interleaves the Llama family's q / k rows for its rotary layout; transformers
    # undoes it by rows, which the worker does on the blocks (`heads`: the row groups to swap back)
    heads = {".attn_q.": model.config.num_attention_heads, ".attn_k.": model.config.num_key_value_heads}
    if processor_class is TensorProcessor:
        heads = {}
    kept = {t.name for _, t in tensors if keeps_blocks and t.name in names and _is_block_tensor(t)}
    check_fits(gguf, [t for _, t in tensors if t.name not in kept], available_bytes())
    blocks: dict[str, dict[str, Any]] = {}
    state: dict[str, torch.Tensor] = {}
    parsed: dict[str, Any] = {"config": model.config.to_dict(), "tensors": {}}
    for shard, tensor in tensors:
        if tensor.name in kept:
            blocks[names[tensor.name]] = _block_entry(tensor, shard, heads)
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name in names:
            state[names[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
    for name, tensor in parsed.get("tensors", {}).items():  # what a processor assembled itself (MoE experts)
        state[name] = tensor.float()
    if model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)
        blocks.pop("lm_head.weight", None)
    save_file(
        {n: t.contiguous() for n, t in state.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    manifest = {"files": [str(shard.resolve()) for shard in shards], "tensors": blocks}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _block_entry(tensor: Any, shard: int, heads: dict[str, int]) -> dict[str, Any]:
    """The manifest's entry of a tensor kept in blocks: where its blocks lie, so the worker maps them without
    parsing the file (gguf-py's reader takes ~8 s over a 49k-token vocabulary's metadata)."""
    permuted = [n for part, n in heads.items() if part in tensor.name]
    return {
        "name": tensor.name,
        "file": shard,  # its shard's index in the manifest's files
        "heads": permuted[0] if permuted else 0,
        "type": tensor.tensor_type.name,
        "offset": int(tensor.data_offset),
        "shape": [int(n) for n in tensor.data.shape],
    }


def available_bytes() -> int:
    """Memory the machine has free now (Linux's MemAvailable; elsewhere, no limit)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def check_fits(gguf: Path, expanded: list[Any], available: int) -> None:
    """ModelLoadError, in one line with the size it needs, where the tensors de-quantized to fp32 (those not kept
    in blocks) would not fit in `available` bytes."""
    need = sum(4 * int(t.n_elements) for t in expanded)
    if need > available:
        types = ", ".join(sorted({t.tensor_type.name for t in expanded}))
        raise ModelLoadError(
            f"{gguf.name}: its {types} tensors de-quantize to {need / 1e9:.1f} GB of fp32, more than the "
            f"{available / 1e9:.1f} GB free here; use a file in {', '.join(BLOCK_TENSORS)} (kept in blocks)"
        )


def _is_block_tensor(tensor: Any) -> bool:
    return tensor.tensor_type.name in BLOCK_TENSORS and len(tensor.shape) == 2


def transformers_source(model_dir: Path) -> tuple[str, dict[str, Any]]:
    """What transformers' `from_pretrained` reads this folder's model from: the folder, or for a GGUF file's
    folder (whose safetensors hold only the small tensors) the GGUF file, de-quantized as transformers does
    (which reads no split model: ModelLoadError)."""
    manifest = model_dir / MANIFEST
    if not manifest.is_file():
        return str(model_dir), {}
    files = json.loads(manifest.read_text())["files"]
    if len(files) > 1:
        raise ModelLoadError(f"transformers reads no split GGUF model ({Path(files[0]).name} is one of {len(files)})")
    gguf = Path(files[0])
    return str(gguf.parent), {"gguf_file": gguf.name, **gguf_config_fields(gguf)}
