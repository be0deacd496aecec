"""What a sliding window buys in KV: the same random Mistral-shaped model with `sliding_window` 256 and with
null, context 4096, a pool of 8192 tokens, 16 conversations of 2,000 prompt tokens arriving together and
128 output tokens each, served by the real scheduler and worker in one process (the engine's loop, with
every step's state read from the scheduler's request table). Printed side by side, one run: the most
requests running at once, the most KV pages one decoding request held (the rule: at most the window and a
page), time to first token, throughput and goodput (the cpu objectives of `shared.slo`), and how well the
step-cost model fitted to the worker's startup probe (as `serve` fits it, windows counted in its attention
pairs) predicts the steps it then times: the median of |predicted / measured - 1| over decode-only steps.

    .venv/bin/python -m batchserve.loadtests.bench_sliding_window [--streams 16] [--prompt 2000] [--output 128]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from batchserve.loadtests.conversations import conversation_arguments, serve_conversations
from batchserve.procs.scheduler import Scheduler
from batchserve.procs.scheduler.config import scheduler_config_from_server
from batchserve.procs.scheduler.step_cost import StepCostModel
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.step_probe import probe_step_costs
from batchserve.shared.config import ServerConfig
from batchserve.shared.slo import DEFAULT_SLOS

SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def build(out_dir: Path, window: int | None) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(sliding_window=window, **SHAPE)).save_pretrained(out_dir)
    return out_dir


def serve(model_dir: Path, streams: int, prompt: int, output: int, page_size: int) -> dict[str, float]:
    config = ServerConfig(
        model=str(model_dir),
        kv_capacity_tokens=8192,
        max_context=4096,
        device="cpu",
        max_running_requests=streams,
        prefill_budget=2048,
        page_size=page_size,
    )
    runner = ModelRunner.from_config(config)  # as the offline engine runs it: no step-time bound
    info = runner.worker_info(probe_step_costs(runner))
    cost = StepCostModel(info.step_costs, windows=info.layer_windows)
    errors: list[float] = []
    execute = runner.execute

    def timed(batch):  # each decode-only step's measured time against the model's prediction
        began = time.perf_counter()
        result = execute(batch)
        if batch.num_tokens == batch.num_requests:
            predicted = cost.predict(cost.shape(batch.prefix_lens, batch.extend_lens))
            errors.append(abs(predicted / (time.perf_counter() - began) - 1))
        return result

    runner.execute = timed
    sched = Scheduler(
        msgspec.structs.replace(scheduler_config_from_server(config, runner.worker_info()), max_step_s=0.0),
        eos_token_ids=runner.eos_token_ids,
    )
    pages = [0]
    run = serve_conversations(
        sched,
        runner,
        streams=streams,
        prompt=prompt,
        output=output,
        vocab=SHAPE["vocab_size"],
        each_step=lambda: pages.append(sched.kv.max_decoding_pages()),
    )
    runner.close()
    return {
        "window": sched.config.sliding_window,
        "most_pages": max(pages),
        "req_per_s": len(run.done) / run.elapsed,
        **run.row(),
        "cost_error_p50": float(np.median(errors)),
    }


def main() -> None:
    parser = conversation_arguments(__doc__)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            serve(build(Path(tmp) / name, window), args.streams, args.prompt, args.output, args.page_size)
            for name, window in (("window256", 256), ("full", None))
        ]
    print(
        f"{args.streams} streams x {args.prompt} prompt + {args.output} output tokens, pool 8192 tokens, "
        f"page {args.page_size}; goodput objectives: {DEFAULT_SLOS['cpu'].label()}"
    )
    keys = list(rows[0])
    print("  ".join(f"{k:>13}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]:>13.3f}" if isinstance(row[k], float) else f"{row[k]:>13}" for k in keys))
    print(
        f"requests at once, window vs full: {rows[0]['most_running'] / rows[1]['most_running']:.2f}x; "
        f"most pages per decoding request with the window: {rows[0]['most_pages']} "
        f"(window + 1 page = {-(-256 // args.page_size) + 1})"
    )


if __name__ == "__main__":
    main()
