"""A GGUF model served in its blocks against the same file de-quantized at load (fp32 panels, and int8 panels
with `--quantization int8`), same prompts, same process, same threads: load seconds, the bytes of the linear
layers' weights, prefill tokens/s and decode tokens/s at a few batch sizes (the fastest of `--repeats`, the
three forms alternating).

    .venv/bin/python -P -m batchserve.loadtests.bench_gguf_blocks [--model PATH.gguf] [--batch-sizes 1,16]
"""

from __future__ import annotations

import argparse
import contextlib
import time
import unittest.mock
from collections.abc import Iterator

import numpy as np
import torch

from batchserve.kernels.panel_linear import PanelWeight
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight
from batchserve.loadtests.bench_engine import run_engine
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.models import weights
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.model import resolve_model

FORMS = {"blocks": "none", "fp32": "none", "int8": "int8"}  # form -> --quantization


@contextlib.contextmanager
def dequantized_at_load(form: str) -> Iterator[None]:
    """The loader de-quantizing every block weight (the path before blocks were kept), for `form` fp32."""
    if form == "blocks":
        yield
        return
    init = weights.WeightTaker.__init__

    def no_blocks(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.keeps_blocks = False

    with unittest.mock.patch.object(weights.WeightTaker, "__init__", no_blocks):
        yield


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of every linear layer's weight (and the LM head's, where it is not the embedding's)."""
    seen: set[int] = set()
    total = 0
    for layer in [*runner.model.layers, runner.model]:
        for value in vars(layer).values():
            weight = getattr(value, "weight", None)
            if isinstance(weight, BlockWeight | BlockParts) and id(weight) not in seen:
                total += weight.nbytes
            elif isinstance(weight, PanelWeight) and id(weight) not in seen:
                total += weight.packed.numel() * weight.packed.element_size()
            seen.add(id(weight))
    return total


def measure(model: str, form: str, batch_sizes: list[int], prompt_len: int, steps: int, prefill_len: int) -> dict:
    started = time.perf_counter()
    with dequantized_at_load(form):
        runner = ModelRunner(
            model,
            device="cpu",
            quantization=FORMS[form],
            kv_capacity_tokens=max(batch_sizes) * (prompt_len + steps + 8) + prefill_len + 64,
            max_running_requests=max(batch_sizes),
            max_context=max(prompt_len + steps, prefill_len) + 64,
        )
    out = {"load_s": time.perf_counter() - started, "weight_bytes": weight_bytes(runner)}
    rng = np.random.default_rng(0)
    prefill_s, _, _ = run_engine(runner, rng.integers(100, runner.vocab_size, (1, prefill_len)).tolist(), 1)
    out["prefill_tok_s"] = prefill_len / prefill_s
    for b in batch_sizes:
        _, decode_s, _ = run_engine(runner, rng.integers(100, runner.vocab_size, (b, prompt_len)).tolist(), steps)
        out[f"decode_b{b}_tok_s"] = b * steps / decode_s
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="runs per form; the fastest counts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, batch_sizes = str(resolve_model(args.model)), [int(b) for b in args.batch_sizes.split(",")]
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for form in FORMS:
            run = measure(model, form, batch_sizes, args.prompt_len, args.decode_steps, args.prefill_len)
            for key, value in run.items():
                keep = min if key == "load_s" else max
                best.setdefault(form, {})[key] = keep(best.get(form, {}).get(key, value), value)
    print(f"model {args.model}, threads {torch.get_num_threads()}, best of {args.repeats}")
    keys = list(best["blocks"])
    print(f"{'':>8} " + " ".join(f"{k:>16}" for k in keys))
    for form, row in best.items():
        print(f"{form:>8} " + " ".join(f"{row[k]:>16.4g}" for k in keys))
    for key in keys[2:]:
        print(f"blocks / fp32 {key}: {best['blocks'][key] / best['fp32'][key]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
