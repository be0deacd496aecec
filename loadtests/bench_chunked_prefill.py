"""What prefilling a prompt in chunks costs beside running decodes, on the CPU, per attention path.

A prompt prefilled whole takes one step beside the running requests' decodes and then decode-only steps;
chunked (as the step-time bound cuts it), every one of the same number of steps carries a chunk. Each step
reads every weight either way, so what chunking adds is what a step carrying prefill costs beyond its
tokens. Two paths, alternated in one process: `c` (prefill chunks attend in C from the paged pool, and the
fused decoder call runs mixed steps whole) and `sdpa` (chunks through SDPA, mixed steps through the
per-layer Python loop: the path before `paged_prefill_attention`).

    .venv/bin/python -m batchserve.loadtests.bench_chunked_prefill --running 15 --prompt-len 400 --chunks 146,133,121
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from batchserve.loadtests.bench_engine import StaticPlan
from batchserve.loadtests.bench_step_mix import _batch
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.model import resolve_model

PATHS = ("c", "sdpa")


def _use_path(runner: ModelRunner, path: str) -> None:
    runner.attention.paged_chunks = path == "c"


def measure(
    runner: ModelRunner, running: int, context: int, prompt_len: int, chunks: list[int], repeats: int
) -> dict[tuple[str, str], list[float]]:
    """Seconds per prompt, by (path, whole | chunked), over `repeats` prompts each: the prompt's steps, each
    beside `running` decodes, and as many steps in all as `chunks` has."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, runner.vocab_size, size=context).tolist() for _ in range(running)]
    prompts += [rng.integers(1, runner.vocab_size, size=prompt_len).tolist() for _ in range(4 * repeats)]
    plan = StaticPlan(runner, prompts, new_tokens=4 * repeats * len(chunks) + 2)
    runner.execute(_batch(plan, [(i, prompts[i], 0) for i in range(running)], list(range(running))))
    lens, newcomer = [context] * running, running
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for path in PATHS:
            _use_path(runner, path)
            for shape, steps in (("whole", [prompt_len] + [0] * (len(chunks) - 1)), ("chunked", chunks)):
                started, done = time.perf_counter(), 0
                for tokens in steps:
                    rows = [(i, [1], lens[i]) for i in range(running)]
                    if tokens:
                        rows.append((newcomer, prompts[newcomer][done : done + tokens], done))
                        done += tokens
                    runner.execute(_batch(plan, rows, [newcomer] if tokens else []))
                    lens = [n + 1 for n in lens]
                times.setdefault((path, shape), []).append(time.perf_counter() - started)
                newcomer += 1
    _use_path(runner, "c")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--running", default="15", help="decoding requests beside the prompt, comma list")
    parser.add_argument("--context", type=int, default=430, help="context of the decoding requests")
    parser.add_argument("--prompt-len", type=int, default=400)
    parser.add_argument("--chunks", default="146,133,121", help="the chunked prompt's chunk sizes")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    chunks = [int(v) for v in args.chunks.split(",")]
    if sum(chunks) != args.prompt_len:
        parser.error(f"--chunks add up to {sum(chunks)}, not --prompt-len {args.prompt_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(v) for v in args.running.split(",")]
    runner = ModelRunner(
        resolve_model(args.model),
        device="cpu",
        dtype="float32",
        kv_capacity_tokens=(max(sizes) + 4 * args.repeats) * (args.context + args.prompt_len + 64),
        max_running_requests=max(sizes) + 4 * args.repeats + 1,
    )
    print(f"{'running':>8}{'path':>6}{'whole ms':>10}{'chunked ms':>12}{'chunked/whole':>15}")
    for running in sizes:
        times = measure(runner, running, args.context, args.prompt_len, chunks, args.repeats)
        medians = {key: statistics.median(values) * 1000 for key, values in times.items()}
        for path in PATHS:
            whole, chunked = medians[(path, "whole")], medians[(path, "chunked")]
            print(f"{running:>8}{path:>6}{whole:>10.1f}{chunked:>12.1f}{chunked / whole:>14.3f}x", flush=True)


if __name__ == "__main__":
    main()
