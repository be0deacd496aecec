"""Mixture-of-experts decode and prefill against a dense model of the same active parameters, and against
transformers on the same MoE weights, in one process and one run (`bench_engine`'s measures).

The models are random (a benchmark of speed, not of text): a Mixtral shaped like the default model
(SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads, vocabulary 49152, tied embeddings) with 8
experts of intermediate 768, top 2, and the Llama of the same shape with intermediate 1536 (what two
experts hold). transformers runs each of its `experts_implementation`s; the fastest per batch counts.
Also: how well the step-time bound's step-cost model, fitted to the worker's startup probe and a few live
steps as the scheduler fits it, predicts steps of either model it has not seen.

    .venv/bin/python -m batchserve.loadtests.bench_moe [--batch-sizes 1,8,32] [--decode-steps 16] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from batchserve.loadtests.bench_engine import alternating, run_engine, run_transformers, same_greedy_tokens
from batchserve.procs.scheduler.step_cost import StepCostModel
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.step_probe import probe_batch, probe_step_costs, timed_step
from batchserve.shared.config import QUANTIZATIONS
from batchserve.shared.step_features import StepShape, step_shape

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.02,
)
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def build(out_dir: Path, moe: bool, layers: int, experts: int, top_k: int, expert_intermediate: int) -> Path:
    """Random weights in a Hugging Face folder (transformers' own initialisation, seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if moe:
        config = MixtralConfig(
            **SHAPE,
            num_hidden_layers=layers,
            intermediate_size=expert_intermediate,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
        )
        model = MixtralForCausalLM(config)
    else:
        config = LlamaConfig(**SHAPE, num_hidden_layers=layers, intermediate_size=top_k * expert_intermediate)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    return out_dir


BATCHED_MM_LIMIT = 6 * 2**30  # bytes of gathered expert weights batched_mm may take (the machine has 24 GiB)


def batched_mm_bytes(model_dir: Path, tokens: int) -> int:
    """What transformers' batched_mm experts gather for a step of `tokens`: each (token, choice) pair's
    expert weights (gate | up and down), fp32."""
    config = json.loads((model_dir / "config.json").read_text())
    per_pair = 3 * config["hidden_size"] * config["intermediate_size"] * 4
    return tokens * config["num_experts_per_tok"] * per_pair


def fastest_transformers(
    model_dir: Path, prompts: list[list[int]], steps: int, repeats: int, implementations: tuple[str, ...]
) -> tuple[str, tuple[float, float, list[list[int]]]]:
    """(implementation, its best run) over transformers' experts implementations, each loaded in turn."""
    from transformers import AutoModelForCausalLM

    best: tuple[str, tuple[float, float, list[list[int]]]] | None = None
    for name in implementations:
        gathered = batched_mm_bytes(model_dir, len(prompts) * len(prompts[0]))
        if name == "batched_mm" and gathered > BATCHED_MM_LIMIT:
            print(
                f"  (transformers' batched_mm skipped at {len(prompts)} x {len(prompts[0])} prompt tokens: it "
                f"gathers the chosen experts' weights per token, {gathered / 2**30:.0f} GiB here)"
            )
            continue
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation=name)
        model.eval()
        run_transformers(model, prompts[:1], 2)  # warm-up
        runs = [run_transformers(model, prompts, steps) for _ in range(repeats)]
        run = (min(r[0] for r in runs), min(r[1] for r in runs), runs[0][2])
        if best is None or run[1 if steps else 0] < best[1][1 if steps else 0]:
            best = (name, run)
        del model
    assert best is not None
    return best


def decode_table(runners: dict[str, ModelRunner], moe_dir: Path, prompts_for, args) -> None:
    print(
        f"\ndecode tokens/s (greedy, {args.decode_steps} steps after {args.prompt_len}-token prompts; best of "
        f"{args.repeats}; transformers: the fastest experts_implementation)"
    )
    print(
        f"  {'batch':>5} {'dense':>8} {'moe':>8} {'moe/dense':>10} {'transformers':>13} {'impl':>11} "
        f"{'moe/tf':>7}  same tokens"
    )
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = prompts_for(b, args.prompt_len)
        dense, moe = alternating(
            args.repeats,
            lambda prompts=prompts: run_engine(runners["dense"], prompts, args.decode_steps),
            lambda prompts=prompts: run_engine(runners["moe"], prompts, args.decode_steps),
        )
        impl, tf = fastest_transformers(moe_dir, prompts, args.decode_steps, args.repeats, args.implementations)

        def rate(run: tuple, b: int = b) -> float:
            return b * args.decode_steps / run[1]

        same = sum(same_greedy_tokens(o, t, runners["moe"].eos_token_ids) for o, t in zip(moe[2], tf[2]))
        print(
            f"  {b:>5} {rate(dense):>8.1f} {rate(moe):>8.1f} {rate(moe) / rate(dense):>9.2f}x {rate(tf):>13.1f} "
            f"{impl:>11} {rate(moe) / rate(tf):>6.2f}x  {same}/{b}",
            flush=True,
        )


def prefill_table(runners: dict[str, ModelRunner], moe_dir: Path, prompts_for, args) -> None:
    print(f"\nprefill tokens/s ({args.prefill_len}-token prompts)")
    print(f"  {'prompts':>7} {'dense':>8} {'moe':>8} {'moe/dense':>10} {'transformers':>13} {'impl':>11} {'moe/tf':>7}")
    for b in (1, 4):
        prompts = prompts_for(b, args.prefill_len)
        dense, moe = alternating(
            args.repeats,
            lambda prompts=prompts: run_engine(runners["dense"], prompts, 0),
            lambda prompts=prompts: run_engine(runners["moe"], prompts, 0),
        )
        impl, tf = fastest_transformers(moe_dir, prompts, 0, args.repeats, args.implementations)

        def rate(run: tuple, b: int = b) -> float:
            return b * args.prefill_len / run[0]

        print(
            f"  {b:>7} {rate(dense):>8.1f} {rate(moe):>8.1f} {rate(moe) / rate(dense):>9.2f}x {rate(tf):>13.1f} "
            f"{impl:>11} {rate(moe) / rate(tf):>6.2f}x",
            flush=True,
        )


def step_cost_table(runners: dict[str, ModelRunner], prompts_for, args) -> None:
    """The scheduler's fit (the probe, then live steps of a serving mix) against steps it has not seen; each
    model also fitted on the same steps without the row and chunked-token terms (the model before them), and
    the MoE model without its experts-read term. Live and unseen steps carry up to three prompts' chunks
    beside their decodes, as a scheduler's steps do when it admits several short prompts at once."""
    print(
        "\nstep-cost model: |predicted / measured - 1| on unseen steps, mean (probe + 64 live steps fitted, "
        "as the scheduler fits them)"
    )
    print(f"  {'model':>30} {'decode 1-32':>12} {'mixed':>8} {'all':>8}")
    rng = np.random.default_rng(1)
    for name, runner in runners.items():
        moe, windows = runner.config.moe, runner.cost_windows

        def measured(
            decodes: int, chunks: list[int], runner: ModelRunner = runner, windows: tuple[int, ...] = windows
        ) -> tuple[StepShape, float]:
            prefix, extend = [128] * decodes + [0] * len(chunks), [1] * decodes + chunks
            batch = probe_batch(runner, prefix, extend)
            seconds = min(timed_step(runner, batch) for _ in range(2))
            return step_shape(prefix, extend, windows), seconds

        probe = probe_step_costs(runner)
        live_chunks = ([], [], [32], [128], [16, 48], [24, 24, 24])  # a step admits several short prompts at times
        chunks_of = [list(live_chunks[i]) for i in rng.integers(len(live_chunks), size=64)]
        live = [measured(int(rng.integers(1, 34 - len(c))), c) for c in chunks_of]  # within 33 slots
        unseen = {
            "decode": [measured(b, []) for b in (1, 2, 3, 5, 8, 12, 20, 32)],
            "mixed": [measured(b, c) for b in (2, 9, 24) for c in ([16], [64], [200], [16, 16], [40, 8, 100])],
        }
        experts = (moe.num_experts, moe.top_k) if moe else (0, 0)
        fits = {name: (experts, False), f"{name}, no row/chunk terms": (experts, True)}
        if moe:
            fits["moe, no experts term"] = ((0, 0), False)
        for label, (experts, tokens_only) in fits.items():
            shaped = (lambda s: StepShape(s.tokens, 0.0, s.pairs, 0.0)) if tokens_only else (lambda s: s)
            cost = StepCostModel([(shaped(s), t) for s, t in probe], experts, windows)
            for shape, seconds in live:
                cost.observe(shaped(shape), seconds)
            errors = {k: [abs(cost.predict(shaped(shape)) / s - 1) for shape, s in v] for k, v in unseen.items()}

            def mean(xs: list[float]) -> float:
                return 100 * float(np.mean(xs))

            print(
                f"  {label:>30} {mean(errors['decode']):>11.1f}% {mean(errors['mixed']):>7.1f}% "
                f"{mean(errors['decode'] + errors['mixed']):>7.1f}%",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=768)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest counts")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="the engine's weights")
    parser.add_argument(
        "--implementations",
        default=",".join(EXPERTS_IMPLEMENTATIONS),
        help="transformers' experts_implementation choices to measure",
    )
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-step-cost", action="store_true")
    parser.add_argument("--only-step-cost", action="store_true", help="measure only the step-cost model's error")
    args = parser.parse_args(argv)
    args.implementations = tuple(args.implementations.split(","))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        started = time.perf_counter()
        dirs = {
            name: build(
                Path(tmp) / name, name == "moe", args.layers, args.experts, args.top_k, args.expert_intermediate
            )
            for name in ("dense", "moe")
        }
        capacity = max(max(batches) * (args.prompt_len + args.decode_steps + 32), 4 * (args.prefill_len + 32))
        runners = {
            name: ModelRunner(
                d,
                device="cpu",
                dtype="float32",
                kv_capacity_tokens=capacity,
                max_running_requests=max(batches + [33]),
                quantization=args.quantization,
                max_context=max(args.prompt_len + args.decode_steps, args.prefill_len) + 64,
            )
            for name, d in dirs.items()
        }
        print(
            f"dense: Llama, intermediate {args.top_k * args.expert_intermediate}; moe: Mixtral, {args.experts} "
            f"experts of {args.expert_intermediate}, top {args.top_k}; both {args.layers} layers, hidden 576, "
            f"{args.quantization if args.quantization != 'none' else 'fp32'}, torch threads "
            f"{torch.get_num_threads()} (built in {time.perf_counter() - started:.0f} s)"
        )
        rng = np.random.default_rng(0)

        def prompts_for(b: int, n: int) -> list[list[int]]:
            return rng.integers(100, 49152, size=(b, n)).tolist()

        for runner in runners.values():
            run_engine(runner, prompts_for(2, 16), 2)  # warm-up
        if not args.only_step_cost:
            decode_table(runners, dirs["moe"], prompts_for, args)
        if not args.no_prefill and not args.only_step_cost:
            prefill_table(runners, dirs["moe"], prompts_for, args)
        if not args.no_step_cost:
            step_cost_table(runners, prompts_for, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
