"""What rings buy a model that mixes sliding and global layers: a random Gemma-3-shaped model (12 layers, 5
sliding to 1 global, window 256, one KV head of 64 dims, context 4096) served three ways from one KV
memory budget: its sliding layers in rings (the default), keeping every position (`--full-sliding-kv`),
and its all-global twin (`sliding_window: null`). 16 conversations of 2,000 prompt tokens arrive together
and take 128 output tokens each, through the real scheduler and worker in one process (the engine's loop).
Printed side by side, one run: the KV bytes a request holds at 2,000 tokens (its global layers' pages and
its sliding layers' ring, from the worker's pool), the pool's pages for the global layers, the most
requests running at once, time to first token, throughput and goodput (the cpu objectives of `shared.slo`).

    .venv/bin/python -m batchserve.loadtests.bench_ring_kv [--streams 16] [--prompt 2000] [--output 128] \\
        [--kv-memory-gb 0.05]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import msgspec
import torch

from batchserve.loadtests.conversations import conversation_arguments, serve_conversations
from batchserve.procs.scheduler import Scheduler
from batchserve.procs.scheduler.config import scheduler_config_from_server
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import ServerConfig
from batchserve.shared.slo import DEFAULT_SLOS

SHAPE = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=12,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=4096,
    sliding_window_pattern=6,
    query_pre_attn_scalar=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
AT_TOKENS = 2000


def build(out_dir: Path, window: int | None) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(SHAPE["num_hidden_layers"])]
    config = Gemma3TextConfig(
        sliding_window=window or 4096, layer_types=kinds if window else ["full_attention"] * len(kinds), **SHAPE
    )
    Gemma3ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def request_kv_bytes(runner: ModelRunner, tokens: int) -> int:
    """The KV bytes one request holds at `tokens` tokens: every non-ring layer's position, a ring per ring layer."""
    cache = runner.kv_cache
    per_token = [k.shape[2] * k.shape[3] * k.element_size() * 2 for k in cache.k]  # K and V of one position
    ring_tokens = cache.ring_pages * cache.page_size
    return sum(b * (ring_tokens if layer in cache.ring_layers else tokens) for layer, b in enumerate(per_token))


def serve(model_dir: Path, args: argparse.Namespace, full_sliding_kv: bool) -> dict[str, float]:
    config = ServerConfig(
        model=str(model_dir),
        kv_memory_gb=args.kv_memory_gb,
        max_context=4096,
        device="cpu",
        max_running_requests=args.streams,
        prefill_budget=2048,
        page_size=16,
        full_sliding_kv=full_sliding_kv,
    )
    runner = ModelRunner.from_config(config)
    sched = Scheduler(
        msgspec.structs.replace(scheduler_config_from_server(config, runner.worker_info()), max_step_s=0.0),
        eos_token_ids=runner.eos_token_ids,
    )
    run = serve_conversations(
        sched, runner, streams=args.streams, prompt=args.prompt, output=args.output, vocab=SHAPE["vocab_size"]
    )
    row = {
        "rings": len(runner.kv_cache.ring_layers),
        "kv_mb_per_req": request_kv_bytes(runner, AT_TOKENS) / 1e6,
        "pool_pages": runner.kv_cache.num_pages - 1,
        **run.row(),
    }
    runner.close()
    return row


def main() -> None:
    parser = conversation_arguments(__doc__)
    parser.add_argument("--kv-memory-gb", type=float, default=0.05)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mixed, twin = build(Path(tmp) / "mixed", 256), build(Path(tmp) / "global", None)
        warm = argparse.Namespace(**{**vars(args), "streams": 2, "prompt": 64, "output": 4})
        for model_dir in (mixed, twin):  # the first run of each pays one-off costs: not measured
            serve(model_dir, warm, False)
        rows = {
            "rings": serve(mixed, args, False),
            "full_sliding_kv": serve(mixed, args, True),
            "all_global": serve(twin, args, False),
        }
    print(
        f"{args.streams} streams x {args.prompt} prompt + {args.output} output tokens, KV budget "
        f"{args.kv_memory_gb} GiB, page 16; goodput objectives: {DEFAULT_SLOS['cpu'].label()}"
    )
    keys = list(rows["rings"])
    print(f"{'':>16}" + "  ".join(f"{k:>14}" for k in keys))
    for name, row in rows.items():
        print(
            f"{name:>16}"
            + "  ".join(f"{row[k]:>14.3f}" if isinstance(row[k], float) else f"{row[k]:>14}" for k in keys)
        )
    ring, twin_row = rows["rings"], rows["all_global"]
    print(
        f"KV bytes per request at {AT_TOKENS} tokens, rings vs all-global: "
        f"{ring['kv_mb_per_req'] / twin_row['kv_mb_per_req']:.2f}x; requests at once: "
        f"{ring['most_running'] / twin_row['most_running']:.2f}x; goodput: {ring['goodput']:.2f} vs "
        f"{twin_row['goodput']:.2f} req/s"
    )


if __name__ == "__main__":
    main()
