"""Write a random-weight model of the default model's shape (SmolLM2-135M-Instruct: LlamaForCausalLM,
hidden 576, 30 layers, 9 heads, 3 KV heads, vocab 49152) as a Hugging Face folder the worker loads.

For the device check (tests/gpu/check.sh): the GPU box cannot receive the real weights (a run carries
at most ~60 MiB; the GGUF is 98 MB, the fp32 safetensors 540 MB), and speed, memory, capture and
graph-vs-eager equality need no trained weights. The shape comes from `--config` (the default
model's config.json, staged by tests/gpu/stage.sh) or, without it, from the copy below; `--layers`
shrinks it (the CPU dry run). `--tokenizer-dir` copies tokenizer and generation files beside the
weights (never config.json or weights); without them the check uses random prompts.

`--moe` makes it a mixture of experts of the same shape: Qwen3-MoE's architecture (q/k norms per head),
8 experts of intermediate 768, top 2, renormalised (the default model's MLP of 1536 is two of them), its
routers scaled up so that bf16 rounding rarely flips a top-k choice.

Usage: python tests/gpu/random_model.py OUT_DIR [--config config.json] [--tokenizer-dir DIR]
           [--layers N] [--moe] [--dtype bfloat16] [--device cuda] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# The default model's config.json (the fields that shape it), for runs without a staged copy.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# Copied from --tokenizer-dir: everything but these (config and weights come from here).
SKIP_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SKIP_NAMES = {"config.json", "model.safetensors.index.json"}
MOE_FIELDS = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
}
ROUTER_SCALE = 10.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", type=Path, help="a config.json (default: SmolLM2-135M's shape, built in)")
    parser.add_argument("--tokenizer-dir", type=Path, help="copy tokenizer/generation files from here")
    parser.add_argument("--layers", type=int, default=0, help="num_hidden_layers (0: the config's)")
    parser.add_argument("--moe", action="store_true", help="a mixture of experts of the same shape (Qwen3-MoE)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the saved weights")
    parser.add_argument("--device", default="cpu", help="where the random init runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    fields = json.loads(args.config.read_text()) if args.config else dict(SMOLLM2_135M)
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    if args.moe:
        fields.update(MOE_FIELDS)
    model_type = fields.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config)
    if args.moe:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.mul_(ROUTER_SCALE)
    model = model.to(getattr(torch, args.dtype)).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    copied = []
    if args.tokenizer_dir:
        for path in sorted(args.tokenizer_dir.iterdir()):
            if path.is_file() and path.name not in SKIP_NAMES and not path.name.endswith(SKIP_SUFFIXES):
                shutil.copy2(path, args.out / path.name)
                copied.append(path.name)
    params = sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(
        f"random model: {config.architectures[0] if config.architectures else model_type}, "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, heads {config.num_attention_heads}/"
        f"{config.num_key_value_heads}, vocab {config.vocab_size}, {params / 1e6:.1f}M parameters, {args.dtype} "
        f"{size / 2**20:.0f} MiB in {args.out} ({time.perf_counter() - start:.1f} s); "
        f"tokenizer files: {', '.join(copied) if copied else 'none (random prompts)'}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
