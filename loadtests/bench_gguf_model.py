"""A random-weight Llama GGUF file of a real model's shape, for benchmarks against llama.cpp on the same file:
the default model's tokenizer (SmolLM2's, copied from its GGUF), weights drawn at a trained model's scale, every
tensor F32 (quantize it with llama.cpp's `llama-quantize F32-FILE OUT-FILE Q4_K_M`), or every 2-D weight in one
block type written directly by `kernels.block_quantize` (`--type q8_0 | q4_0 | q4_k`; no F32 file on the way,
which an 8B model would need 32 GB for).

    .venv/bin/python -P -m batchserve.loadtests.bench_gguf_model --shape llama-1b --out /tmp/llama-1b-f32.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Llama-3.2-1B's and Llama-3-8B's decoder (vocabulary: SmolLM2's 49152, the tokenizer the file carries)
SHAPES: dict[str, dict[str, int]] = {
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    "llama-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
}
STD = 0.02  # a trained model's weight scale (initializer_range)


def copy_tokenizer(writer: Any, source: Path) -> int:
    """The tokenizer.* fields of GGUF `source` into `writer`; the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    size = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            size = len(value)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    return size


def tensors(shape: dict[str, int], vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """llama.cpp's tensor names and [out, in] shapes (embeddings tied, as SmolLM2's and Llama-3.2-1B's are)."""
    h, kv = shape["hidden"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    out = [("token_embd.weight", (vocab, h)), ("output_norm.weight", (h,))]
    for i in range(shape["layers"]):
        out += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (h, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, h)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape["intermediate"], h)),
            (f"blk.{i}.ffn_up.weight", (shape["intermediate"], h)),
            (f"blk.{i}.ffn_down.weight", (h, shape["intermediate"])),
        ]
    return out


def write(shape_name: str, out: Path, block: str, seed: int) -> None:
    import gguf

    from batchserve.kernels.block_quantize import quantize_weight
    from batchserve.shared.model import KNOWN_MODELS, _locate_known_gguf

    shape = SHAPES[shape_name]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(8192)
    writer.add_block_count(shape["layers"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = copy_tokenizer(writer, _locate_known_gguf(next(iter(KNOWN_MODELS))))
    rng = np.random.default_rng(seed)
    for name, dims in tensors(shape, vocab):
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, np.float32))
            continue
        values = (rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float32)
        if block == "f32":
            writer.add_tensor(name, values)
            continue
        blocks = quantize_weight(torch.from_numpy(values), block, head=name == "token_embd.weight")
        writer.add_tensor(name, blocks.data.numpy(), raw_dtype=gguf.GGMLQuantizationType(blocks.kind.id))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--type", choices=["f32", "q8_0", "q4_0", "q4_k"], default="f32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    write(args.shape, args.out, args.type, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
