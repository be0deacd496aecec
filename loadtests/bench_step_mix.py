"""What one worker step costs by composition: decode-only, prefill-only, and mixed (decodes + a prefill).

Explains `batchserve bench --compare` results: under `mixed` almost every step of a busy server
carries a new request's prefill next to the running decodes; under `prefill-first` the same
prefill runs as its own step. Same runner, same process, steps alternated, median of repeats.

    .venv/bin/python -m batchserve.loadtests.bench_step_mix --running 8,32 --prefill-len 100 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from batchserve.loadtests.bench_engine import GREEDY, StaticPlan
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.messages import ForwardBatch
from batchserve.shared.model import resolve_model


def _batch(plan: StaticPlan, rows: list[tuple[int, list[int], int]], pages_for: list[int]) -> ForwardBatch:
    """rows: (request index, tokens fed, prefix length); `pages_for`: requests whose pages are set now."""
    i32 = lambda xs: np.asarray(xs, dtype=np.int32)  # noqa: E731
    plan.step += 1
    return ForwardBatch(
        step=plan.step,
        slots=[i for i, _, _ in rows],
        prefix_lens=[p for _, _, p in rows],
        extend_lens=[len(t) for _, t, _ in rows],
        sample_lens=[1] * len(rows),
        sampling=[GREEDY] * len(rows),
        sample_counts=[0] * len(rows),
        input_ids=i32([x for _, t, _ in rows for x in t]),
        positions=i32([p + j for _, t, p in rows for j in range(len(t))]),
        kv_locs=i32([plan._loc(i, p + j) for i, t, p in rows for j in range(len(t))]),
        page_table_slots=i32([i for i in pages_for for _ in plan.pages[i]]),
        page_table_cols=i32([c for i in pages_for for c in range(len(plan.pages[i]))]),
        page_table_pages=i32([pg for i in pages_for for pg in plan.pages[i]]),
    )


def measure(runner: ModelRunner, running: int, prompt_len: int, prefill_len: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    prompts = [rng.integers(1, vocab, size=prompt_len).tolist() for _ in range(running)]
    prompts.append(rng.integers(1, vocab, size=prefill_len).tolist())  # the newcomer
    plan = StaticPlan(runner, prompts, new_tokens=2 * repeats + 2)
    runner.execute(_batch(plan, [(i, prompts[i], 0) for i in range(running)], list(range(running))))
    lens = [prompt_len] * running
    new = running
    times: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": []}

    def decode_rows() -> list[tuple[int, list[int], int]]:
        return [(i, [1], lens[i]) for i in range(running)]

    for _ in range(repeats):
        for kind in ("decode", "prefill", "mixed"):
            if kind == "decode":
                batch = _batch(plan, decode_rows(), [])
            elif kind == "prefill":
                batch = _batch(plan, [(new, prompts[new], 0)], [new])
            else:
                batch = _batch(plan, decode_rows() + [(new, prompts[new], 0)], [new])
            started = time.perf_counter()
            runner.execute(batch)
            times[kind].append(time.perf_counter() - started)
            if kind != "prefill":
                lens = [n + 1 for n in lens]
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--running", default="8,32", help="decoding requests in the batch, comma list")
    parser.add_argument("--prompt-len", type=int, default=100, help="context of the running requests")
    parser.add_argument("--prefill-len", type=int, default=100, help="prompt tokens of the newcomer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(v) for v in args.running.split(",")]
    runner = ModelRunner(
        resolve_model(args.model),
        device="cpu",
        dtype="float32",
        kv_capacity_tokens=(max(sizes) + 1) * (args.prompt_len + args.prefill_len + 64) + 1024,
        max_running_requests=max(sizes) + 1,
    )
    print(f"{'running':>8}{'decode ms':>11}{'prefill ms':>12}{'decode+prefill':>16}{'mixed ms':>10}{'mixed/sum':>11}")
    for n in sizes:
        t = measure(runner, n, args.prompt_len, args.prefill_len, args.repeats)
        both = t["decode"] + t["prefill"]
        print(
            f"{n:>8}{t['decode']:>11.1f}{t['prefill']:>12.1f}{both:>16.1f}"
            f"{t['mixed']:>10.1f}{t['mixed'] / both:>10.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
