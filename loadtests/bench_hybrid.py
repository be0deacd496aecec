"""A hybrid linear-attention model (Gated DeltaNet layers beside full attention, Qwen3.5's decoder) against
its all-full-attention twin, in one process and one run: memory per request and decode speed at a long
context, and how well the step-time bound's step-cost model predicts each model's steps.

The models are random (a benchmark of speed and memory, not of text), shaped like the default model
(SmolLM2-135M: hidden 576, 9 heads of 64 with 3 KV heads, intermediate 1536, vocabulary 49152, tied
embeddings), 28 layers: the hybrid three linear layers to each full one (9 key and 9 value heads of 64 in
the linear layers), the twin every layer full. fp32, as the CPU serves.

- bytes per request at `--context` tokens: the KV pages of its full layers, plus the hybrid's state;
- decode tokens/s at batch `--batch` with every row `--context` tokens in (each request's KV on its own
  pages, as a served batch reads them), the best of `--repeats` timed runs of `--steps` steps;
- the step-cost model fitted as the scheduler fits it (the startup probe and 64 live steps) against steps
  it has not seen (`bench_moe.step_cost_table`);
- the prefix cache (the hybrid's serves a prefix where its linear layers' state was kept): requests sharing
  a system prompt through the scheduler, one first and then the rest together, with the cache and without,
  for both models: the prompt tokens it served and the wall time.

    .venv/bin/python -m batchserve.loadtests.bench_hybrid [--context 2000] [--batch 32] [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from batchserve.loadtests.bench_moe import step_cost_table
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.step_probe import GREEDY
from batchserve.shared.messages import ForwardBatch

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    linear_num_key_heads=9,
    linear_num_value_heads=9,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.02,
)


def build(out_dir: Path, layers: int, hybrid: bool) -> Path:
    """Random weights in a Hugging Face folder (transformers' own initialisation, seed 0)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    kinds = ["linear_attention" if hybrid and (i + 1) % 4 else "full_attention" for i in range(layers)]
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, num_hidden_layers=layers, layer_types=kinds)).save_pretrained(out_dir)
    return out_dir


def bytes_per_request(runner: ModelRunner, context: int) -> int:
    cache = runner.kv_cache
    per_token = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v)) // (cache.num_pages * cache.page_size)
    states = 0 if cache.states is None else cache.states.bytes_per_request
    return per_token * context + states


def decode_batch(runner: ModelRunner, batch: int, context: int) -> ForwardBatch:
    """One decode row per slot, each after `context` tokens on pages of its own (the page table set)."""
    cache, size = runner.kv_cache, runner.page_size
    pages_each = context // size + 1
    slots = np.repeat(np.arange(batch), pages_each).astype(np.int32)
    cols = np.tile(np.arange(pages_each), batch).astype(np.int32)
    pages = (1 + np.arange(batch * pages_each)).astype(np.int32)
    cache.apply_page_table_updates(slots, cols, pages)
    positions = np.full(batch, context, dtype=np.int32)
    kv_locs = (pages.reshape(batch, pages_each)[:, context // size] * size + context % size).astype(np.int32)
    ids = ((np.arange(batch) * 7919 + 11) % runner.vocab_size).astype(np.int32)
    empty = np.zeros(0, dtype=np.int32)
    return ForwardBatch(
        step=0,
        slots=list(range(batch)),
        prefix_lens=[context] * batch,
        extend_lens=[1] * batch,
        sample_lens=[1] * batch,
        sampling=[GREEDY] * batch,
        sample_counts=[0] * batch,
        input_ids=ids,
        positions=positions,
        kv_locs=kv_locs,
        page_table_slots=empty,
        page_table_cols=empty,
        page_table_pages=empty,
    )


def decode_rate(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Tokens/s of `steps` decode steps (the same rows again: the cost is the step's, whatever the tokens)."""
    step = decode_batch(runner, batch, context)
    runner.execute(step)  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        runner.execute(step)
    return batch * steps / (time.perf_counter() - started)


def shared_prompt_run(
    runner: ModelRunner, cache: bool, requests: int, shared: int, own: int, new_tokens: int
) -> tuple[float, float]:
    """(share of prompt tokens the prefix cache served, seconds) for `requests` prompts of `shared` common
    tokens and `own` more each, the first alone, then the others together, `new_tokens` each."""
    from batchserve.procs.scheduler import Scheduler
    from batchserve.procs.scheduler.config import scheduler_config_from_server
    from batchserve.shared.config import ServerConfig
    from batchserve.shared.messages import RequestParams, StopParams

    info = runner.worker_info()
    config = scheduler_config_from_server(
        ServerConfig(model="-", disable_prefix_cache=not cache, max_running_requests=runner.max_running_requests - 1),
        info,
    )
    scheduler = Scheduler(config, eos_token_ids=())
    rng = np.random.default_rng(3)
    system = rng.integers(100, 49152, size=shared).tolist()
    params = RequestParams(stop=StopParams(max_tokens=new_tokens, ignore_eos=True))
    started = time.perf_counter()
    for wave in (range(1), range(1, requests)):
        for i in wave:
            scheduler.add_request(f"r{i}", system + rng.integers(100, 49152, size=own).tolist(), params)
        while scheduler.has_unfinished():
            scheduler.step(runner)
    kv = scheduler.kv
    return kv.hit_tokens / max(kv.queried_tokens, 1), time.perf_counter() - started


def prefix_cache_table(runners: dict[str, ModelRunner]) -> None:
    shared, own, requests = 512, 32, 16
    print(
        f"\nprefix cache: {requests} prompts of {shared} shared + {own} own tokens, 16 new tokens each (the first "
        f"alone, then the rest), through the scheduler"
    )
    for name, runner in runners.items():
        for cache in (False, True):
            served, seconds = shared_prompt_run(runner, cache, requests, shared, own, 16)
            print(
                f"  {name:>6} cache {'on ' if cache else 'off'}: prompt tokens served from the cache "
                f"{100 * served:5.1f}%, {seconds:6.1f} s",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per model, alternating; the fastest counts")
    parser.add_argument("--no-step-cost", action="store_true")
    parser.add_argument("--only-step-cost", action="store_true", help="measure only the step-cost model's error")
    parser.add_argument("--no-prefix-cache", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as tmp:
        started = time.perf_counter()
        runners = {}
        for name in ("full", "hybrid"):
            folder = build(Path(tmp) / name, args.layers, name == "hybrid")
            runners[name] = ModelRunner(
                folder,
                device="cpu",
                dtype="float32",
                max_running_requests=max(args.batch, 33),
                kv_capacity_tokens=args.batch * (args.context + 32),
                max_context=args.context + 64,
                state_snapshots=max(args.batch, 33),
            )
        print(
            f"{args.layers} layers, hidden 576, 9 heads of 64 (3 KV heads), fp32; hybrid: 3 Gated DeltaNet layers "
            f"to 1 full; torch threads {torch.get_num_threads()} (built in {time.perf_counter() - started:.0f} s)"
        )
        sizes = {name: bytes_per_request(runner, args.context) for name, runner in runners.items()}
        print(
            f"\nbytes per request at {args.context} tokens: full {sizes['full'] / 2**20:.1f} MiB, hybrid "
            f"{sizes['hybrid'] / 2**20:.1f} MiB (of which state "
            f"{runners['hybrid'].kv_cache.states.bytes_per_request / 2**20:.2f} MiB; beside it "
            f"{runners['hybrid'].kv_cache.states.num_snapshots} snapshots for the prefix cache): "
            f"{sizes['hybrid'] / sizes['full']:.2f}x"
        )
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(0 if args.only_step_cost else args.repeats):
            for name, runner in runners.items():
                rates[name].append(decode_rate(runner, args.batch, args.context, args.steps))
        best = {name: max(r, default=0.0) for name, r in rates.items()}
        if not args.only_step_cost:
            print(
                f"decode tokens/s at batch {args.batch}, {args.context} tokens in (best of {args.repeats}): full "
                f"{best['full']:.1f}, hybrid {best['hybrid']:.1f}: {best['hybrid'] / best['full']:.2f}x"
            )
        if not args.no_step_cost:
            rng = np.random.default_rng(0)
            step_cost_table(runners, lambda b, n: rng.integers(100, 49152, size=(b, n)).tolist(), args)
        if not args.no_prefix_cache and not args.only_step_cost:
            prefix_cache_table(runners)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
