"""Device check of the worker's decode paths: CUDA-graph replay, flashinfer, and the torch reference.

Prints, in one run:
1. greedy token equality (8 requests, bfloat16, default model) of CUDA-graph replay vs eager vs the
   torch backend, once with all requests decoding together and once with staggered arrivals (batch
   sizes 1..8 and mixed prefill+decode steps);
2. graph capture time and device memory (torch.cuda.mem_get_info before/after capture);
3. decode tokens/s at batch 1, 8, 32, 64 with and without graphs, side by side.
Exit status: 0 all tokens equal, 1 a token mismatch, 2 the check cannot run here.

`--device cpu` runs the same measurements for the padded static-buffer path (what graphs replay)
against the unpadded eager path. Installs nothing; run it through tests/gpu/check.sh.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: model_batches
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from model_batches import GREEDY, generate_greedy  # noqa: E402
from procs.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import DEFAULT_MODEL  # noqa: E402
from shared.messages import ForwardBatch  # noqa: E402

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU cache is.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into French.",
    "What is 12 times 12?",
    "Name a colour of the rainbow.",
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def flashinfer_status() -> str | None:
    """None when flashinfer imports, else why not."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not available here"
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class Variant:
    label: str
    backend: str
    graphs: bool  # True: the padded static-buffer path (replaying CUDA graphs where captured); False: plain eager


def build_runner(args: argparse.Namespace, variant: Variant, max_running: int) -> ModelRunner:
    return ModelRunner(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                       kv_memory_gb=args.kv_memory_gb, max_running_requests=max_running, max_context=args.max_context,
                       attention_backend=variant.backend, disable_cuda_graph=not variant.graphs,
                       pad_decode=variant.graphs)


def release_memory() -> None:
    """After the caller dropped its runner: free its tensors before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_memory(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if device.startswith("cuda") else 0


def describe_graphs(runner: ModelRunner) -> str:
    graphs = runner.graph_runner
    if graphs is None:
        return "graphs disabled"
    if not graphs.uses_cuda_graphs:
        return f"padded eager path (no capture), sizes {graphs.batch_sizes}"
    return (f"captured {len(graphs.batch_sizes)} graphs {graphs.batch_sizes} in {graphs.capture_seconds:.2f} s, "
            f"{graphs.capture_bytes / 2**20:.1f} MiB (mem_get_info before/after capture)")


# -- 1. token equality ------------------------------------------------------------------------------


def chat_prompts(model: str, count: int) -> list[list[int]]:
    try:
        from procs.worker.loader import load_tokenizer

        tokenizer = load_tokenizer(model)
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False))
                for c in (CHATS * (count // len(CHATS) + 1))[:count]]
    except Exception as exc:  # noqa: BLE001 - a model folder without tokenizer files still gets checked
        log(f"no tokenizer ({exc}); using random prompts")
        rng = np.random.default_rng(0)
        return [rng.integers(10, 1000, size=int(rng.integers(8, 40))).tolist() for _ in range(count)]


def equality_variants(args: argparse.Namespace, flashinfer_missing: str | None) -> list[Variant]:
    if not args.device.startswith("cuda"):
        return [Variant("torch padded", "torch", True), Variant("torch eager", "torch", False)]
    variants = []
    if flashinfer_missing is None:
        variants += [Variant("flashinfer graphs", "flashinfer", True), Variant("flashinfer eager", "flashinfer", False)]
    variants += [Variant("torch eager", "torch", False), Variant("torch padded", "torch", True)]
    return variants


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_equality(args: argparse.Namespace, flashinfer_missing: str | None) -> bool:
    prompts = chat_prompts(args.model, args.requests)
    scenarios = {"together": {"arrival_gap": 0}, "staggered": {"arrival_gap": 1}}
    results: dict[str, dict[str, list[list[int]]]] = {name: {} for name in scenarios}
    for variant in equality_variants(args, flashinfer_missing):
        free_before = free_memory(args.device)
        start = time.perf_counter()
        runner = build_runner(args, variant, max_running=args.requests)
        log(f"{variant.label}: built in {time.perf_counter() - start:.1f} s, "
            f"{(free_before - free_memory(args.device)) / 2**20:.0f} MiB; {describe_graphs(runner)}")
        for name, kwargs in scenarios.items():
            start = time.perf_counter()
            results[name][variant.label] = generate_greedy(runner, prompts, args.new_tokens, **kwargs)
            log(f"  {name}: {args.requests} x {args.new_tokens} tokens in {time.perf_counter() - start:.2f} s")
        del runner
        release_memory()
    all_equal = True
    for name, outputs in results.items():
        labels = list(outputs)
        reference = labels[0]
        for label in labels[1:]:
            diverged = {i: first_divergence(outputs[reference][i], outputs[label][i]) for i in range(len(prompts))}
            mismatched = {i: at for i, at in diverged.items() if at is not None}
            status = ("EQUAL" if not mismatched
                      else f"MISMATCH in {len(mismatched)} requests (request: first differing token) {mismatched}")
            print(f"tokens [{name}] {label} vs {reference}: {status}", flush=True)
            all_equal &= not mismatched
    return all_equal


# -- 3. decode throughput ---------------------------------------------------------------------------


class DecodeBench:
    """`batch_size` requests with `prompt_len`-token prompts in contiguous pages, then decode steps."""

    def __init__(self, runner: ModelRunner, batch_size: int, prompt_len: int, steps: int, seed: int = 0):
        self.runner = runner
        self.page_size = runner.page_size
        self.batch_size = batch_size
        total = prompt_len + steps + 1
        self.pages_per_request = -(-total // self.page_size)
        needed = 1 + batch_size * self.pages_per_request
        if needed > runner.kv_cache.num_pages:
            raise ValueError(f"KV pool too small: needs {needed} pages, has {runner.kv_cache.num_pages}")
        if total > runner.max_context:
            raise ValueError(f"prompt_len + steps {total} exceeds max_context {runner.max_context}")
        self.slots = np.arange(batch_size, dtype=np.int32)
        self.first_page = 1 + self.slots * self.pages_per_request
        self.rng = np.random.default_rng(seed)
        self.prompt_len = prompt_len
        self.positions = np.zeros(batch_size, dtype=np.int32)
        self.last_tokens = np.zeros(batch_size, dtype=np.int32)
        self.step = 0

    def kv_locs(self, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        pages = self.first_page[slots] + positions // self.page_size
        return (pages * self.page_size + positions % self.page_size).astype(np.int32)

    def prefill(self) -> None:
        n, length = self.batch_size, self.prompt_len
        slots = np.repeat(self.slots, length)
        positions = np.tile(np.arange(length, dtype=np.int32), n)
        cols = np.tile(np.arange(self.pages_per_request, dtype=np.int32), n)
        batch = ForwardBatch(
            step=self.step, slots=self.slots.tolist(), prefix_lens=[0] * n, extend_lens=[length] * n,
            samples=[True] * n, sampling=[GREEDY] * n, sample_counts=[0] * n,
            input_ids=self.rng.integers(10, 1000, size=n * length).astype(np.int32), positions=positions,
            kv_locs=self.kv_locs(positions, slots),
            page_table_slots=np.repeat(self.slots, self.pages_per_request),
            page_table_cols=cols,
            page_table_pages=(np.repeat(self.first_page, self.pages_per_request) + cols).astype(np.int32),
        )
        self.last_tokens = self.runner.execute(batch).next_token_ids
        self.positions[:] = length
        self.step += 1

    def decode(self) -> None:
        n = self.batch_size
        empty = np.zeros(0, dtype=np.int32)
        batch = ForwardBatch(
            step=self.step, slots=self.slots.tolist(), prefix_lens=self.positions.tolist(), extend_lens=[1] * n,
            samples=[True] * n, sampling=[GREEDY] * n, sample_counts=[1] * n,
            input_ids=self.last_tokens.astype(np.int32), positions=self.positions.copy(),
            kv_locs=self.kv_locs(self.positions, self.slots),
            page_table_slots=empty, page_table_cols=empty, page_table_pages=empty,
        )
        self.last_tokens = self.runner.execute(batch).next_token_ids  # .cpu() inside: the step has finished
        self.positions += 1
        self.step += 1


def bench_decode(args: argparse.Namespace) -> None:
    """Both runners hold the same batch; their decode steps alternate in rounds (shared-machine noise
    hits both alike) and each side reports its median round."""
    backend = "auto" if args.device.startswith("cuda") else "torch"
    on_label, off_label = ("graphs", "no graphs") if args.device.startswith("cuda") else ("padded", "unpadded")
    max_running = args.max_running or max(args.batch_sizes)
    runners: dict[str, ModelRunner] = {}
    for label, graphs in ((on_label, True), (off_label, False)):
        free_before = free_memory(args.device)
        runners[label] = build_runner(args, Variant(label, backend, graphs), max_running=max_running)
        log(f"bench {label}: backend {runners[label].attention.name}, {describe_graphs(runners[label])}, "
            f"runner {(free_before - free_memory(args.device)) / 2**20:.0f} MiB")
    steps = args.warmup_steps + args.rounds * args.round_steps
    clock = time.process_time if args.clock == "process" else time.perf_counter
    rows = []
    for batch_size in args.batch_sizes:
        benches = {label: DecodeBench(runner, batch_size, args.prompt_len, steps) for label, runner in runners.items()}
        for bench in benches.values():
            bench.prefill()
            for _ in range(args.warmup_steps):
                bench.decode()
        rates: dict[str, list[float]] = {label: [] for label in benches}
        for _ in range(args.rounds):
            for label, bench in benches.items():
                start = clock()
                for _ in range(args.round_steps):
                    bench.decode()
                rates[label].append(batch_size * args.round_steps / (clock() - start))
        on, off = float(np.median(rates[on_label])), float(np.median(rates[off_label]))
        log(f"  batch {batch_size}: {on_label} {on:.1f}, {off_label} {off:.1f} tokens/s")
        rows.append((batch_size, on, off))
    print(f"decode tokens/s by {args.clock} time (prompt {args.prompt_len}, median of {args.rounds} alternating "
          f"rounds of {args.round_steps} steps after {args.warmup_steps} warm-up; sampling and host sync included)")
    print(f"{'batch':>6} {on_label:>12} {off_label:>12} {'ratio':>7}")
    for batch_size, on, off in rows:
        print(f"{batch_size:>6} {on:>12.1f} {off:>12.1f} {on / off:>7.2f}")


# -- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-memory-gb", type=float, default=2.0)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-running", type=int, default=0,
                        help="benchmark runners' max_running_requests, hence graph sizes (0: the largest batch size)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--round-steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="process: CPU time of this process (steadier than wall time on a shared CPU box)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--skip-equality", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available here: nothing to check (use --device cpu for the padded path)")
        return 2
    missing = flashinfer_status()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    log(f"torch {torch.__version__}, device {device_name}, dtype {args.dtype}, model {args.model}, "
        f"flashinfer {'available' if missing is None else 'MISSING (' + missing + ')'}")
    if args.device.startswith("cuda") and missing is not None:
        print("note: without flashinfer no CUDA graph is captured (the torch backend's plan is not capturable); "
              "the padded path runs eagerly instead")
    all_equal = True
    try:
        if not args.skip_equality:
            all_equal = check_equality(args, missing)
        if not args.skip_bench:
            bench_decode(args)
    except ValueError as exc:  # bad arguments for this model or pool
        print(f"error: {exc}")
        return 2
    print("RESULT: tokens equal" if all_equal else "RESULT: TOKEN MISMATCH")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
