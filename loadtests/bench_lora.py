"""Multi-LoRA's cost in the worker: decode tokens/s of a batch whose rows are spread over `--adapters`
rank-`--rank` adapters of all seven projections, against the same batch on the base model alone, in one
process and one run (alternating, the fastest of `--repeats` each; `bench_engine`'s measure).

The models are random (a benchmark of speed, not of text): a Llama shaped like the default model
(SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocabulary 49152, tied
embeddings), fp32, and PEFT adapters made on it with `init_lora_weights=False`.

    .venv/bin/python -m batchserve.loadtests.bench_lora [--batch 16] [--adapters 4] [--rank 16] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from batchserve.loadtests.bench_engine import alternating, run_engine
from batchserve.loadtests.bench_moe import SHAPE
from batchserve.procs.worker.lora.step import load_lora_adapter, lora_of
from batchserve.procs.worker.model_runner import ModelRunner

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(out_dir: Path, layers: int, adapters: int, rank: int) -> tuple[Path, list[Path]]:
    """The base model and `adapters` PEFT folders on it (transformers' and PEFT's initialisation, seed 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = out_dir / "base"
    LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=layers, intermediate_size=1536)).save_pretrained(base)
    folders = []
    for i in range(adapters):
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False)
        )
        folders.append(out_dir / f"adapter{i}")
        peft.save_pretrained(folders[-1])
    return base, folders


@contextlib.contextmanager
def spread_over(runner: ModelRunner, batch: int, adapters: int) -> Iterator[None]:
    """During decode, row i runs adapter i % adapters + 1 (the prefill ran on the base model)."""
    lora_of(runner).slot_adapter[:batch] = np.arange(batch) % adapters + 1
    try:
        yield
    finally:
        lora_of(runner).slot_adapter[:] = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        started = time.perf_counter()
        base, folders = build(Path(tmp), args.layers, args.adapters, args.rank)
        runner = ModelRunner(
            base,
            device="cpu",
            dtype="float32",
            max_running_requests=max(args.batch, 8),
            kv_capacity_tokens=args.batch * (args.prompt_len + args.decode_steps + 32),
            max_context=args.prompt_len + args.decode_steps + 64,
        )
        for index, folder in enumerate(folders, 1):
            load_lora_adapter(runner, index, f"adapter{index}", str(folder), max_rank=args.rank)
        print(
            f"Llama of the default model's shape, {args.layers} layers, fp32, torch threads {torch.get_num_threads()}; "
            f"{args.adapters} adapters of rank {args.rank} on all seven projections (built in "
            f"{time.perf_counter() - started:.0f} s)"
        )
        rng = np.random.default_rng(0)
        prompts = rng.integers(100, 49152, size=(args.batch, args.prompt_len)).tolist()
        run_engine(runner, prompts[:2], 2)  # warm-up

        def lora():
            return run_engine(
                runner,
                prompts,
                args.decode_steps,
                around_decode=lambda: spread_over(runner, args.batch, args.adapters),
            )

        base_run, lora_run = alternating(args.repeats, lambda: run_engine(runner, prompts, args.decode_steps), lora)

        def rate(run: tuple) -> float:
            return args.batch * args.decode_steps / run[1]

        print(
            f"decode tokens/s at batch {args.batch} (best of {args.repeats}): base {rate(base_run):.1f}, rows over "
            f"{args.adapters} adapters {rate(lora_run):.1f}: {rate(lora_run) / rate(base_run):.2f}x"
        )
        if runner.model.fuse_decode_layers:  # the same adapter rows layer by layer, as before they joined the C call
            fused_run, loop_run = alternating(args.repeats, lora, lambda: layer_by_layer(runner, lora))
            print(
                f"rows over {args.adapters} adapters: in the one C decode call {rate(fused_run):.1f}, layer by layer "
                f"{rate(loop_run):.1f}: {rate(fused_run) / rate(loop_run):.2f}x"
            )
    return 0


def layer_by_layer(runner: ModelRunner, run: Callable[[], tuple]) -> tuple:
    runner.model.fuse_decode_layers = False
    try:
        return run()
    finally:
        runner.model.fuse_decode_layers = True


if __name__ == "__main__":
    raise SystemExit(main())
