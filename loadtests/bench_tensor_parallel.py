"""Tensor parallelism on this CPU: TP=2 (2 worker ranks x 1 torch thread, gloo) against TP=1 (one
process x 2 threads), in one run, rounds alternated, medians.

Prints decode tokens/s at batch 1, 8 and 32 (prompts of --prompt-len tokens) and prefill tokens/s of
one --prefill-len prompt for:
- `tp1`: one runner, 2 threads, as served today (the fused C decode path: every layer in one call);
- `tp1 per-layer`: the same with the fused path off: the per-layer path TP=2 must use (its all-reduces
  sit between the layers), so the reader sees what the fused path alone is worth;
- `tp2`: rank 0 in this process through the `OfflineEngine` (its follower a spawned process), with
  the share of rank 0's step spent in the layers' all-reduces and the logits' all-gather
  (`TensorParallel.collective_s`, waiting for the other rank included) and in the step broadcast;
- `tp1 default model`: the real default weights, 2 threads (see below).

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) does not split over 2 ranks (9 heads do
not divide by 2; 3 KV heads neither divide nor are divided by 2), so the runs use a random-weight
twin of its shape with 8 query heads and 4 KV heads of 64 (tests/gpu/random_model.py): the same
hidden size, MLP, vocabulary and layers, and the same projection parameter count (576 x 1024 for
q/k/v and 512 x 576 for o, against 576 x 960 and 576 x 576). `tp1 default model` shows the twin costs
what the real model does. Two cores: expect no gain; the ratios say what TP costs here.

    .venv/bin/python -m batchserve.loadtests.bench_tensor_parallel [--rounds 5] \\
        [--out loadtests/results/tensor_parallel_cpu.txt]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from batchserve.loadtests.bench_engine import StaticPlan
from batchserve.procs.engine import OfflineEngine
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig, cache_dir
from batchserve.shared.model import resolve_model

REPO = Path(__file__).resolve().parents[1]
TWIN_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


def twin_model(default_dir: Path) -> Path:
    """The default model's config with TWIN_HEADS, random fp32 weights, its tokenizer files; built once."""
    out = cache_dir() / "bench" / "smollm2-135m-heads8-kv4"
    if (out / "model.safetensors").is_file():
        return out
    fields = json.loads((default_dir / "config.json").read_text())
    fields.update(TWIN_HEADS)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.parent / "smollm2-135m-heads8-kv4.json"
    config.write_text(json.dumps(fields))
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/gpu/random_model.py"),
            str(out),
            "--config",
            str(config),
            "--tokenizer-dir",
            str(default_dir),
            "--dtype",
            "float32",
        ],
        check=True,
    )
    return out


@dataclass
class Variant:
    """One side of the comparison: a runner, reached through `use` (which also sets the torch threads)."""

    label: str
    use: Callable[[], contextlib.AbstractContextManager[ModelRunner]]
    decode: dict[int, list[float]] = field(default_factory=dict)  # batch -> tokens/s per round
    prefill: list[float] = field(default_factory=list)
    collective_share: dict[int | str, list[float]] = field(default_factory=dict)
    broadcast_share: dict[int | str, list[float]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # batch 1's greedy tokens, for the equality line


class BroadcastClock:
    """Host seconds rank 0 spends broadcasting steps (wraps its `RankSteps.lead`)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.seconds = 0.0
        lead = runner.rank_steps.lead

        def timed(*args, **kwargs) -> None:
            started = time.perf_counter()
            lead(*args, **kwargs)
            self.seconds += time.perf_counter() - started

        runner.rank_steps.lead = timed  # type: ignore[method-assign]


def _plain(runner: ModelRunner, threads: int) -> Callable[[], contextlib.AbstractContextManager[ModelRunner]]:
    @contextlib.contextmanager
    def use() -> Iterator[ModelRunner]:
        torch.set_num_threads(threads)
        yield runner

    return use


def _engine(engine: OfflineEngine, threads: int) -> Callable[[], contextlib.AbstractContextManager[ModelRunner]]:
    @contextlib.contextmanager
    def use() -> Iterator[ModelRunner]:
        torch.set_num_threads(threads)
        with engine.direct_runner() as runner:
            yield runner

    return use


def _timed_steps(variant: Variant, key: int | str, run: Callable[[ModelRunner], None]) -> float:
    """Seconds of `run` on the variant's runner; records the collective and broadcast shares for TP runs."""
    with variant.use() as runner:
        clock = getattr(runner, "broadcast_clock", None)
        collective0, broadcast0 = runner.tp.collective_s, clock.seconds if clock else 0.0
        started = time.perf_counter()
        run(runner)
        seconds = time.perf_counter() - started
        if runner.tp.world_size > 1:
            variant.collective_share.setdefault(key, []).append((runner.tp.collective_s - collective0) / seconds)
            variant.broadcast_share.setdefault(key, []).append((clock.seconds - broadcast0) / seconds)
    return seconds


def bench(variants: list[Variant], batch_sizes: list[int], args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    steps = args.warmup_steps + args.rounds * args.round_steps + 1
    for batch in batch_sizes:
        prompts = [rng.integers(10, 40000, size=args.prompt_len).tolist() for _ in range(batch)]
        state: dict[str, tuple[StaticPlan, list[int]]] = {}
        for v in variants:
            with v.use() as runner:
                plan = StaticPlan(runner, prompts, steps)
                last = runner.execute(plan.prefill()).next_token_ids.tolist()
                for _ in range(args.warmup_steps):
                    last = runner.execute(plan.decode(last)).next_token_ids.tolist()
                    if batch == 1:
                        v.tokens += last
                state[v.label] = (plan, last)
        for _ in range(args.rounds):
            for v in variants:
                plan, last = state[v.label]

                def decode(runner: ModelRunner, plan: StaticPlan = plan, batch: int = batch, v: Variant = v) -> None:
                    nonlocal last
                    for _ in range(args.round_steps):
                        last = runner.execute(plan.decode(last)).next_token_ids.tolist()
                        if batch == 1:
                            v.tokens += last

                v.decode.setdefault(batch, []).append(batch * args.round_steps / _timed_steps(v, batch, decode))
                state[v.label] = (plan, last)
        print(
            f"  batch {batch}: "
            + ", ".join(f"{v.label} {statistics.median(v.decode[batch]):.1f}" for v in variants)
            + " tokens/s",
            flush=True,
        )
    prompt = [rng.integers(10, 40000, size=args.prefill_len).tolist()]
    plans = {}
    for v in variants:
        with v.use() as runner:
            plans[v.label] = StaticPlan(runner, prompt, 1)
            runner.execute(plans[v.label].prefill())  # warm-up
    for _ in range(args.rounds):
        for v in variants:
            plan = plans[v.label]
            seconds = _timed_steps(v, "prefill", lambda runner, plan=plan: runner.execute(plan.prefill()))
            v.prefill.append(args.prefill_len / seconds)
    print(
        f"  prefill {args.prefill_len}: "
        + ", ".join(f"{v.label} {statistics.median(v.prefill):.0f}" for v in variants)
        + " tokens/s",
        flush=True,
    )


def table(variants: list[Variant], batch_sizes: list[int], args: argparse.Namespace) -> list[str]:
    med = statistics.median
    base = variants[0]
    lines = [f"{'':<22}" + "".join(f"{v.label:>18}" for v in variants)]
    for batch in batch_sizes:
        lines.append(f"{f'decode b={batch} tok/s':<22}" + "".join(f"{med(v.decode[batch]):>18.1f}" for v in variants))
    lines.append(f"{f'prefill {args.prefill_len} tok/s':<22}" + "".join(f"{med(v.prefill):>18.0f}" for v in variants))
    lines.append("")
    lines.append("ratios to tp1 (higher = faster)")
    for batch in batch_sizes:
        lines.append(
            f"{f'decode b={batch}':<22}"
            + "".join(f"{med(v.decode[batch]) / med(base.decode[batch]):>18.2f}" for v in variants)
        )
    lines.append(f"{'prefill':<22}" + "".join(f"{med(v.prefill) / med(base.prefill):>18.2f}" for v in variants))
    per_layer = next(v for v in variants if v.label == "tp1 per-layer")
    tp2 = next(v for v in variants if v.label == "tp2")
    lines.append("")
    lines.append("tp2 / tp1 per-layer (TP's own cost, the fused path aside)")
    for batch in batch_sizes:
        lines.append(f"{f'decode b={batch}':<22}{med(tp2.decode[batch]) / med(per_layer.decode[batch]):>18.2f}")
    lines.append(f"{'prefill':<22}{med(tp2.prefill) / med(per_layer.prefill):>18.2f}")
    lines.append("")
    lines.append(
        "share of a tp2 step on rank 0 (median over rounds): all-reduce + all-gather (collective_s, "
        "waiting for rank 1 included) | step broadcast"
    )
    for key in [*batch_sizes, "prefill"]:
        name = f"decode b={key}" if key != "prefill" else f"prefill {args.prefill_len}"
        collective, broadcast = med(tp2.collective_share[key]), med(tp2.broadcast_share[key])
        lines.append(f"{name:<22}{100 * collective:>17.1f}%{100 * broadcast:>17.1f}%")
    n = min(len(base.tokens), len(tp2.tokens))
    same = base.tokens[:n] == tp2.tokens[:n]
    lines.append("")
    lines.append(f"batch 1 greedy tokens, tp2 vs tp1 (twin model, {n} tokens): {'equal' if same else 'DIFFERENT'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128, help="context of the decoding requests")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="tp1's torch threads; tp2's rank 0 runs threads // 2, its follower cores // 2 (as joining sets it)",
    )
    parser.add_argument("--out", type=Path, help="also write the command and the table here")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    default_dir = resolve_model(DEFAULT_MODEL)
    twin = twin_model(default_dir)
    tokens = max(batch_sizes) * (args.prompt_len + args.warmup_steps + args.rounds * args.round_steps + 16)
    sizes = dict(
        device="cpu",
        dtype="float32",
        kv_capacity_tokens=max(tokens, args.prefill_len + 64),
        max_running_requests=max(batch_sizes),
        max_context=max(args.prompt_len + 256, args.prefill_len + 64),
    )
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    engine = OfflineEngine(ServerConfig(model=str(twin), tensor_parallel_size=2, **sizes))
    engine.runner.broadcast_clock = BroadcastClock(engine.runner)  # type: ignore[attr-defined]
    try:
        tp1 = ModelRunner(twin, **sizes)
        per_layer = ModelRunner(twin, **sizes)
        per_layer.model.fuse_decode_layers = False
        real = ModelRunner(default_dir, **sizes)
        print(
            f"loaded in {time.perf_counter() - started:.1f} s; fused decode path: tp1 "
            f"{tp1.model.fuse_decode_layers}, tp1 per-layer {per_layer.model.fuse_decode_layers}, "
            f"tp2 {engine.runner.model.fuse_decode_layers}",
            flush=True,
        )
        variants = [
            Variant("tp1", _plain(tp1, args.threads)),
            Variant("tp1 per-layer", _plain(per_layer, args.threads)),
            Variant("tp2", _engine(engine, max(1, args.threads // 2))),
            Variant("tp1 default model", _plain(real, args.threads)),
        ]
        bench(variants, batch_sizes, args)
    finally:
        engine.close()
    command = " ".join(argv if argv is not None else sys.argv[1:])
    header = [
        f"# .venv/bin/python -m batchserve.loadtests.bench_tensor_parallel {command}",
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; tp1: 1 process x {args.threads} threads; tp2: 2 ranks (gloo) x "
        f"{max(1, args.threads // 2)} thread",
        f"# model: {twin} (random twin of {DEFAULT_MODEL}: heads 8/4 instead of 9/3, which do not split over 2 "
        f"ranks); 'tp1 default model': {default_dir}",
        f"# decode: {args.rounds} alternating rounds of {args.round_steps} steps after {args.warmup_steps} "
        f"warm-up, prompts of {args.prompt_len} tokens; prefill: one {args.prefill_len}-token prompt per round; "
        f"medians; sampling and the step broadcast included",
        f"# load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after: other work on these "
        f"cores skews every side, the alternated rounds spread it",
        "",
    ]
    lines = header + table(variants, batch_sizes, args)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
