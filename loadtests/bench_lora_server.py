"""Multi-LoRA through the whole server: one `batchserve serve` of the default model with `--adapters` random
rank-`--rank` PEFT adapters on all seven projections (`--enable-lora --max-loras N`), and the same closed-loop
load sent alternately naming the base model and spread over the adapters (request i names adapter i mod N),
output tok/s of each, `--rounds` times.

    .venv/bin/python -m batchserve.loadtests.bench_lora_server --rounds 3 --concurrency 16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from batchserve.loadtests.bench import bench_once
from batchserve.loadtests.bench_lora import PROJECTIONS
from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, ServerProcess
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.gguf_convert import transformers_source
from batchserve.shared.model import resolve_model


def make_adapters(out_dir: Path, count: int, rank: int) -> list[Path]:
    """PEFT adapters on the default model (`init_lora_weights=False`: B is not zero, the adapters change the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(count):
        torch.manual_seed(i)
        source, kwargs = transformers_source(resolve_model(DEFAULT_MODEL))
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
        peft = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False)
        )
        folders.append(out_dir / f"adapter{i}")
        peft.save_pretrained(folders[-1])
    return folders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="64:128")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-server-"))
    folders = make_adapters(work, args.adapters, args.rank)
    names = [f"adapter{i}" for i in range(args.adapters)]
    command = [
        *DEFAULT_SERVE_COMMAND,
        "--enable-lora",
        "--max-loras",
        str(args.adapters),
        "--max-lora-rank",
        str(args.rank),
        "--max-running-requests",
        str(args.concurrency),
        *(arg for name, folder in zip(names, folders) for arg in ("--lora-modules", f"{name}={folder}")),
    ]
    results: dict[str, list[float]] = {"base": [], "adapters": []}
    with ServerProcess(command, work / "serve.log") as server:
        bench_once(
            server.base_url,
            argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}),
            99,
            work / "warmup.json",
            "--spread-models",
            ",".join(names),
        )
        for index in range(2 * args.rounds):
            kind = ("base", "adapters")[(index + index // 2) % 2]  # base, adapters, adapters, base, ...
            spread = ",".join(names) if kind == "adapters" else ""
            metrics = bench_once(server.base_url, args, index, work / f"run{index}.json", "--spread-models", spread)
            results[kind].append(metrics["output_throughput"])
            print(
                f"run {index}: {kind:8s} output {metrics['output_throughput']:6.1f} tok/s  TPOT p50 "
                f"{metrics['tpot_ms']['p50']:6.1f} ms  completed {metrics['completed']}",
                flush=True,
            )
    base, lora = (sum(v) / len(v) for v in (results["base"], results["adapters"]))
    print(f"mean output tok/s: base {base:.1f}, spread over {args.adapters} adapters {lora:.1f}: {lora / base:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
