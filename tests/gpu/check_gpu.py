"""Device check of the worker's decode paths: CUDA-graph replay, flashinfer, and the torch reference.

Prints, in one run:
1. greedy token equality (8 requests, bfloat16, default model) of CUDA-graph replay vs eager vs the
   torch backend, once with all requests decoding together and once with staggered arrivals (batch
   sizes 1..8 and mixed prefill+decode steps; `--graph-max-bs` below `--requests` adds decode batches
   above the largest captured size, which run eagerly); then the same steps teacher-forced (every
   variant fed the first variant's tokens), comparing each step's logits: argmax agreement and the
   largest logits difference relative to the logits' spread;
2. graph capture time and device memory (torch.cuda.mem_get_info before/after capture);
3. decode tokens/s at batch 1, 8, 32, 64 with and without graphs, side by side;
4. `--kv-capacity`: the KV pool the worker sizes by default (`kv_memory_gb=0`: on CUDA
   `--kv-memory-fraction` of the memory free after the weights), in tokens and in whole contexts;
5. `--tp N`: tensor parallelism, N ranks (one per GPU, NCCL; gloo with `--device cpu`) against TP=1
   on `--tp-model`: greedy tokens (and teacher-forced logits) and decode tokens/s side by side;
   skipped, saying so, with fewer GPUs than ranks.
Exit status: 0 all tokens equal, 1 a token mismatch, 2 the check cannot run here.

Random weights (tests/gpu/random_model.py; the real ones cannot reach the GPU box) have near-ties
between top logits that bf16 rounding differences (another GEMM shape, another attention kernel)
can flip, after which free-running greedy outputs diverge. `--tolerate-ties` accepts a free-running
mismatch when the teacher-forced logits agree within `--max-logit-diff` (a broken page table, graph
buffer or mask gives differences of the order of the logits themselves).

`--warmup-flashinfer` only builds a flashinfer runner (capturing its graphs) and runs a few mixed
prefill+decode steps, so flashinfer's JIT compiles its kernels once (tests/gpu/check.sh runs it under
a timeout first). `--json PATH` writes the results as JSON.

`--device cpu` runs the same measurements for the padded static-buffer path (what graphs replay)
against the unpadded eager path. Installs nothing; run it through tests/gpu/check.sh.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: model_batches
# batchserve itself: installed, or the checkout seen as batchserve.* (.ci/pythonpath: links, not the root,
# whose kernels/ folder would shadow Hugging Face's `kernels`)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / ".ci" / "pythonpath"))

from model_batches import GREEDY, _plan, _Request, generate_greedy, step_rows  # noqa: E402

from batchserve.procs.worker.kv_cache import kv_bytes_per_token  # noqa: E402
from batchserve.procs.worker.model_runner import ModelRunner  # noqa: E402
from batchserve.shared.config import DEFAULT_MODEL  # noqa: E402
from batchserve.shared.messages import ForwardBatch  # noqa: E402

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


def build_runner(args: argparse.Namespace, variant: Variant, max_running: int, graph_max_bs: int = 0) -> ModelRunner:
    return ModelRunner(
        args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_memory_gb=args.kv_memory_gb,
        max_running_requests=max_running,
        max_context=args.max_context,
        attention_backend=variant.backend,
        disable_cuda_graph=not variant.graphs,
        cuda_graph_max_bs=graph_max_bs,
        pad_decode=variant.graphs,
    )


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
    return (
        f"captured {len(graphs.batch_sizes)} graphs {graphs.batch_sizes} in {graphs.capture_seconds:.2f} s, "
        f"{graphs.capture_bytes / 2**20:.1f} MiB (mem_get_info before/after capture)"
    )


# -- 1. token equality ------------------------------------------------------------------------------


def chat_prompts(model: str, count: int) -> list[list[int]]:
    try:
        from batchserve.shared.model import load_tokenizer

        tokenizer = load_tokenizer(model)
        return [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for c in (CHATS * (count // len(CHATS) + 1))[:count]
        ]
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


def forced_logits(
    runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]], arrival_gap: int = 0
) -> list[torch.Tensor]:
    """The steps `generate_greedy` would run, teacher-forced: each request is fed `reference`'s tokens
    instead of its own samples. Returns per request its [new tokens, vocab] float32 logits (CPU)."""
    page_size = runner.page_size
    free_pages = list(range(runner.kv_cache.num_pages - 1, 0, -1))
    free_slots = list(range(runner.max_running_requests - 1, -1, -1))
    requests = [_Request(p, i * arrival_gap) for i, p in enumerate(prompts)]
    index = {id(r): i for i, r in enumerate(requests)}
    rows_out: list[list[torch.Tensor]] = [[] for _ in prompts]
    new_tokens = [len(r) for r in reference]
    step = 0
    while any(len(r.output) < n for r, n in zip(requests, new_tokens)):
        rows = step_rows(requests, step, new_tokens, free_slots)
        if not rows:
            step += 1
            continue
        batch = _plan(step, rows, page_size, free_pages)
        with torch.inference_mode():  # with tensor parallelism the other ranks run the same step
            logits = runner.step_logits(batch).float().cpu()
        for row, (r, tokens, _) in enumerate(rows):
            i = index[id(r)]
            r.fed += len(tokens)
            rows_out[i].append(logits[row])
            r.output.append(reference[i][len(r.output)])
            if len(r.output) >= new_tokens[i]:
                free_slots.append(r.slot)
                free_pages.extend(r.pages)
                r.pages = []
        step += 1
    return [torch.stack(rows) for rows in rows_out]


@dataclass
class LogitsDiff:
    rows: int
    argmax_equal: int
    max_abs: float  # largest |logit difference|
    max_rel: float  # largest per-row rms(difference) / std(reference logits)

    def describe(self) -> str:
        return (
            f"argmax equal in {self.argmax_equal}/{self.rows} steps, logits differ by at most {self.max_abs:.3g} "
            f"(rms {100 * self.max_rel:.2f}% of the logits' spread, worst step)"
        )


def compare_logits(reference: list[torch.Tensor], other: list[torch.Tensor]) -> LogitsDiff:
    ref, oth = torch.cat(reference), torch.cat(other)
    diff = oth - ref
    rel = diff.pow(2).mean(dim=-1).sqrt() / ref.std(dim=-1).clamp_min(1e-12)
    return LogitsDiff(
        rows=ref.shape[0],
        argmax_equal=int((ref.argmax(-1) == oth.argmax(-1)).sum()),
        max_abs=float(diff.abs().max()),
        max_rel=float(rel.max()),
    )


def token_status(mismatched: dict[int, int], diff: LogitsDiff, args: argparse.Namespace) -> tuple[str, bool]:
    """How two runs' greedy tokens compare (EQUAL, or where they differ), and whether that passes:
    a divergence passes only at a near tie (--tolerate-ties, teacher-forced logits within --max-logit-diff)."""
    if not mismatched:
        return "EQUAL", True
    status = f"MISMATCH in {len(mismatched)} requests (request: first differing token) {mismatched}"
    if args.tolerate_ties and diff.max_rel <= args.max_logit_diff:
        return status + f"; within ties (teacher-forced logits within {100 * args.max_logit_diff:.0f}%)", True
    return status, False


def check_equality(args: argparse.Namespace, flashinfer_missing: str | None, report: dict) -> bool:
    prompts = chat_prompts(args.model, args.requests)
    scenarios = {"together": {"arrival_gap": 0}, "staggered": {"arrival_gap": 1}}
    results: dict[str, dict[str, list[list[int]]]] = {name: {} for name in scenarios}
    forced: dict[str, dict[str, list[torch.Tensor]]] = {name: {} for name in scenarios}
    for variant in equality_variants(args, flashinfer_missing):
        free_before = free_memory(args.device)
        start = time.perf_counter()
        runner = build_runner(args, variant, max_running=args.requests, graph_max_bs=args.graph_max_bs)
        described = describe_graphs(runner)
        log(
            f"{variant.label}: built in {time.perf_counter() - start:.1f} s, "
            f"{(free_before - free_memory(args.device)) / 2**20:.0f} MiB; {described}"
        )
        report.setdefault("variants", {})[variant.label] = described
        for name, kwargs in scenarios.items():
            start = time.perf_counter()
            results[name][variant.label] = generate_greedy(runner, prompts, args.new_tokens, **kwargs)
            reference = next(iter(results[name].values()))  # the first variant's tokens: everyone is fed those
            forced[name][variant.label] = forced_logits(runner, prompts, reference, **kwargs)
            log(
                f"  {name}: {args.requests} x {args.new_tokens} tokens in {time.perf_counter() - start:.2f} s "
                f"(free-running, then teacher-forced)"
            )
        if runner.graph_runner is not None:
            sizes = dict(sorted(runner.graph_runner.steps_per_size.items()))
            log(f"  padded decode steps by padded size: {sizes}")
        del runner
        release_memory()
    all_equal = True
    for name, outputs in results.items():
        labels = list(outputs)
        reference = labels[0]
        distinct = len({t for out in outputs[reference] for t in out})
        log(f"[{name}] {reference} produced {distinct} distinct tokens in {args.requests} x {args.new_tokens}")
        for label in labels[1:]:
            diverged = {i: first_divergence(outputs[reference][i], outputs[label][i]) for i in range(len(prompts))}
            mismatched = {i: at for i, at in diverged.items() if at is not None}
            diff = compare_logits(forced[name][reference], forced[name][label])
            status, ok = token_status(mismatched, diff, args)
            print(f"tokens [{name}] {label} vs {reference}: {status}", flush=True)
            print(f"  teacher-forced [{name}] {label} vs {reference}: {diff.describe()}", flush=True)
            report.setdefault("equality", []).append(
                {
                    "scenario": name,
                    "variant": label,
                    "reference": reference,
                    "mismatched_requests": mismatched,
                    "forced_argmax_equal": diff.argmax_equal,
                    "forced_steps": diff.rows,
                    "forced_max_abs": diff.max_abs,
                    "forced_max_rel": diff.max_rel,
                    "ok": ok,
                }
            )
            all_equal &= ok
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
            step=self.step,
            slots=self.slots.tolist(),
            prefix_lens=[0] * n,
            extend_lens=[length] * n,
            sample_lens=[1] * n,
            sampling=[GREEDY] * n,
            sample_counts=[0] * n,
            input_ids=self.rng.integers(10, 1000, size=n * length).astype(np.int32),
            positions=positions,
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
            step=self.step,
            slots=self.slots.tolist(),
            prefix_lens=self.positions.tolist(),
            extend_lens=[1] * n,
            sample_lens=[1] * n,
            sampling=[GREEDY] * n,
            sample_counts=[1] * n,
            input_ids=self.last_tokens.astype(np.int32),
            positions=self.positions.copy(),
            kv_locs=self.kv_locs(self.positions, self.slots),
            page_table_slots=empty,
            page_table_cols=empty,
            page_table_pages=empty,
        )
        self.last_tokens = self.runner.execute(batch).next_token_ids  # .cpu() inside: the step has finished
        self.positions += 1
        self.step += 1


def bench_decode(args: argparse.Namespace, report: dict) -> None:
    """Both runners hold the same batch; their decode steps alternate in rounds (shared-machine noise
    hits both alike) and each side reports its median round."""
    backend = "auto" if args.device.startswith("cuda") else "torch"
    on_label, off_label = ("graphs", "no graphs") if args.device.startswith("cuda") else ("padded", "unpadded")
    max_running = args.max_running or max(args.batch_sizes)
    runners: dict[str, ModelRunner] = {}
    for label, graphs in ((on_label, True), (off_label, False)):
        free_before = free_memory(args.device)
        runners[label] = build_runner(args, Variant(label, backend, graphs), max_running=max_running)
        log(
            f"bench {label}: backend {runners[label].attention.name}, {describe_graphs(runners[label])}, "
            f"runner {(free_before - free_memory(args.device)) / 2**20:.0f} MiB"
        )
        graph_runner = runners[label].graph_runner
        if graph_runner is not None and graph_runner.uses_cuda_graphs:
            report["capture"] = {
                "sizes": graph_runner.batch_sizes,
                "seconds": graph_runner.capture_seconds,
                "bytes": graph_runner.capture_bytes,
            }
    report["bench_backend"] = runners[on_label].attention.name
    rows = []
    for batch_size, rates in decode_rates(runners, args).items():
        on, off = rates[on_label], rates[off_label]
        log(f"  batch {batch_size}: {on_label} {on:.1f}, {off_label} {off:.1f} tokens/s")
        rows.append((batch_size, on, off))
        report.setdefault("decode_tokens_per_s", {})[str(batch_size)] = {on_label: on, off_label: off}
    print(
        f"decode tokens/s by {args.clock} time (prompt {args.prompt_len}, median of {args.rounds} alternating "
        f"rounds of {args.round_steps} steps after {args.warmup_steps} warm-up; sampling and host sync included)"
    )
    print(f"{'batch':>6} {on_label:>12} {off_label:>12} {'ratio':>7}")
    for batch_size, on, off in rows:
        print(f"{batch_size:>6} {on:>12.1f} {off:>12.1f} {on / off:>7.2f}")


def decode_rates(runners: dict[str, ModelRunner], args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Decode tokens/s per batch size and runner: every runner holds the same batch, their steps
    alternate in rounds (shared-machine noise hits all alike), each reports its median round."""
    steps = args.warmup_steps + args.rounds * args.round_steps
    clock = time.process_time if args.clock == "process" else time.perf_counter
    out: dict[int, dict[str, float]] = {}
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
        out[batch_size] = {label: float(np.median(r)) for label, r in rates.items()}
    return out


# -- 4. KV capacity ---------------------------------------------------------------------------------


def report_kv_capacity(args: argparse.Namespace, report: dict) -> None:
    """The pool a worker with default settings gets: kv_memory_gb=0, the model's own max_context."""
    free_before = free_memory(args.device)
    start = time.perf_counter()
    runner = ModelRunner(
        args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_memory_gb=0.0,
        kv_memory_fraction=args.kv_memory_fraction,
        max_running_requests=args.kv_max_running,
        max_context=0,
        attention_backend="auto",
        disable_cuda_graph=True,
    )
    capacity, context = runner.kv_capacity_tokens, runner.max_context
    cfg = runner.config
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.dtype)
    taken = free_before - free_memory(args.device)
    where = (
        f"{args.kv_memory_fraction} of the memory free after the weights"
        if args.device.startswith("cuda")
        else "the CPU default"
    )
    print(
        f"KV capacity (kv_memory_gb=0: {where}): {capacity} tokens = {runner.kv_cache.num_pages} pages of "
        f"{runner.page_size}, {per_token} bytes/token, {capacity * per_token / 2**30:.1f} GiB; max_context {context}: "
        f"{capacity // context} full contexts (capacity // max_context)"
        + (
            f"; runner took {taken / 2**30:.1f} GiB of device memory in {time.perf_counter() - start:.1f} s"
            if args.device.startswith("cuda")
            else ""
        ),
        flush=True,
    )
    report["kv"] = {
        "capacity_tokens": capacity,
        "max_context": context,
        "contexts": capacity // context,
        "bytes_per_token": per_token,
        "fraction": args.kv_memory_fraction,
    }
    del runner
    release_memory()


def precompile_flashinfer(args: argparse.Namespace) -> None:
    """Best effort: compile the decode and prefill modules the backend will ask for in ONE ninja run
    (in parallel), instead of one after the other as the first decode and prefill steps would. The
    arguments mirror kernels/attention/flashinfer.py's plan() calls (no positional encoding, no sliding
    window or soft cap, int32 page lists); a mismatch only means the runner compiles on demand."""
    try:
        from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
        from flashinfer.jit.core import build_jit_specs
        from flashinfer.utils import determine_attention_backend

        from batchserve.procs.worker.loader import load_model_config
        from batchserve.shared.model import ModelSpec

        head_dim = load_model_config(ModelSpec.resolve(args.model)).head_dim
        dtype = getattr(torch, args.dtype)
        backend = determine_attention_backend(
            torch.device(args.device), 0, False, False, dtype, dtype, head_dim_qk=head_dim, head_dim_vo=head_dim
        )
        specs = [
            gen_batch_decode_module(dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False),
            gen_batch_prefill_module(
                backend, dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False
            ),
        ]
        start = time.perf_counter()
        build_jit_specs(specs)
        log(
            f"flashinfer warm-up: compiled {[spec.name[:40] + '...' for spec in specs]} (prefill backend "
            f"{backend}) in {time.perf_counter() - start:.1f} s"
        )
    except Exception as exc:  # noqa: BLE001 - the runner below compiles what it needs anyway
        log(f"flashinfer warm-up: no parallel precompile ({type(exc).__name__}: {exc}); compiling on first use")


def warmup_flashinfer(args: argparse.Namespace) -> int:
    """Make flashinfer JIT-compile (or load) its decode and prefill kernels for this model's shape."""
    missing = flashinfer_status()
    if missing is not None:
        print(f"flashinfer warm-up: flashinfer does not import: {missing}")
        return 2
    start = time.perf_counter()
    precompile_flashinfer(args)
    runner = build_runner(args, Variant("flashinfer graphs", "flashinfer", True), max_running=4)
    log(f"flashinfer warm-up: runner built in {time.perf_counter() - start:.1f} s; {describe_graphs(runner)}")
    generate_greedy(runner, chat_prompts(args.model, 3), 4, arrival_gap=1)  # prefill, mixed and decode steps
    log(f"flashinfer warm-up: done in {time.perf_counter() - start:.1f} s")
    return 0


# -- 5. tensor parallelism --------------------------------------------------------------------------


def check_tensor_parallel(args: argparse.Namespace, report: dict) -> bool:
    """TP=`--tp` against TP=1 on `--tp-model`: rank 0 in this process, the other ranks spawned
    processes (`procs.engine.FollowerRanks`; cuda:RANK with NCCL, or gloo on the CPU). Greedy tokens
    free-running (staggered arrivals: mixed prefill+decode steps) and teacher-forced logits (ties, as
    `check_equality`), then decode tokens/s of both, rounds alternated. Skipped (True) with fewer GPUs
    than ranks."""
    from batchserve.procs.engine import FollowerRanks
    from batchserve.shared.config import ServerConfig
    from batchserve.shared.parallel import with_init_addr

    label = f"tp{args.tp}"
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        line = (
            f"TP={args.tp} check: SKIPPED: {torch.cuda.device_count()} GPU visible, TP={args.tp} needs "
            f"{args.tp} (one rank per GPU)"
        )
        print(line, flush=True)
        report["tp"] = {"skipped": line}
        return True
    model = str(args.tp_model or args.model)
    max_running = max(args.requests, *args.batch_sizes)
    # A generous step timeout: the followers wait in it while this process runs the TP=1 side.
    config = with_init_addr(
        ServerConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            page_size=args.page_size,
            kv_memory_gb=args.kv_memory_gb,
            max_running_requests=max_running,
            max_context=args.max_context,
            tensor_parallel_size=args.tp,
            step_timeout_s=300.0,
        )
    )
    start = time.perf_counter()
    followers = FollowerRanks(config, args.tp)
    try:
        runner = ModelRunner.from_config(config)
    except BaseException:
        followers.close()
        raise
    try:
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        log(
            f"{label}: {args.tp} ranks ({backend}) built in {time.perf_counter() - start:.1f} s; rank 0 on "
            f"{runner.device}, {runner.model.heads.num_heads} query / {runner.model.heads.num_kv_heads} KV heads per "
            f"rank, {runner.kv_capacity_tokens} KV tokens; {describe_graphs(runner)}"
        )
        tp1 = ModelRunner(
            model,
            device=args.device,
            dtype=args.dtype,
            page_size=args.page_size,
            kv_memory_gb=args.kv_memory_gb,
            max_running_requests=max_running,
            max_context=args.max_context,
        )
        log(f"tp1: {describe_graphs(tp1)}")
        prompts = chat_prompts(model, args.requests)
        reference = generate_greedy(tp1, prompts, args.new_tokens, arrival_gap=1)
        got = generate_greedy(runner, prompts, args.new_tokens, arrival_gap=1)
        diff = compare_logits(
            forced_logits(tp1, prompts, reference, arrival_gap=1),
            forced_logits(runner, prompts, reference, arrival_gap=1),
        )
        mismatched = {i: at for i in range(len(prompts)) if (at := first_divergence(reference[i], got[i])) is not None}
        status, ok = token_status(mismatched, diff, args)
        print(f"tokens [staggered] {label} vs tp1: {status}", flush=True)
        print(f"  teacher-forced [staggered] {label} vs tp1: {diff.describe()}", flush=True)
        report["tp"] = {
            "ranks": args.tp,
            "backend": backend,
            "mismatched_requests": mismatched,
            "ok": ok,
            "forced_argmax_equal": diff.argmax_equal,
            "forced_steps": diff.rows,
            "forced_max_abs": diff.max_abs,
            "forced_max_rel": diff.max_rel,
        }
        if not args.skip_bench:
            collective_before, started = runner.tp.collective_s, time.perf_counter()
            rates = decode_rates({"tp1": tp1, label: runner}, args)
            print(
                f"decode tokens/s, {label} ({backend}) vs tp1 (prompt {args.prompt_len}, median of {args.rounds} "
                f"alternating rounds of {args.round_steps} steps; {label} rank 0 spent "
                f"{runner.tp.collective_s - collective_before:.2f} s host time in all-reduce/all-gather calls over "
                f"the {time.perf_counter() - started:.1f} s of both sides' steps)"
            )
            print(f"{'batch':>6} {'tp1':>12} {label:>12} {'ratio':>7}")
            for batch_size, by in rates.items():
                print(f"{batch_size:>6} {by['tp1']:>12.1f} {by[label]:>12.1f} {by[label] / by['tp1']:>7.2f}")
            report["tp"]["decode_tokens_per_s"] = {str(b): by for b, by in rates.items()}
        del tp1
        return ok
    finally:
        runner.close()
        followers.close()
        release_memory()


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
    parser.add_argument(
        "--graph-max-bs",
        type=int,
        default=0,
        help="equality runners' cuda_graph_max_bs (0: --requests); below --requests, larger "
        "decode batches run eagerly beside replayed ones",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument(
        "--max-running",
        type=int,
        default=0,
        help="benchmark runners' max_running_requests, hence graph sizes (0: the largest batch size)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--round-steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="process: CPU time of this process (steadier than wall time on a shared CPU box)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--skip-equality", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--tolerate-ties",
        action="store_true",
        help="random weights: accept free-running token mismatches when the teacher-forced "
        "logits differ by at most --max-logit-diff",
    )
    parser.add_argument(
        "--max-logit-diff",
        type=float,
        default=0.10,
        help="largest per-step rms logits difference, relative to the logits' std, that "
        "--tolerate-ties counts as rounding (default 0.10; bf16 vs float32 on a random 30-layer "
        "model: about 0.02; a corrupted context: above 1)",
    )
    parser.add_argument("--kv-capacity", action="store_true", help="report the default KV pool size (section 4)")
    parser.add_argument("--kv-memory-fraction", type=float, default=0.85)
    parser.add_argument("--kv-max-running", type=int, default=64, help="max_running_requests of the KV runner")
    parser.add_argument(
        "--warmup-flashinfer",
        action="store_true",
        help="only build a flashinfer runner and run a few steps (JIT compile), then exit",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=0,
        help="also check tensor parallelism: this many ranks against TP=1 (section 5; skipped with "
        "fewer GPUs than ranks)",
    )
    parser.add_argument("--tp-only", action="store_true", help="run only the TP check (section 5)")
    parser.add_argument(
        "--tp-model",
        type=Path,
        default=None,
        help="the model of the TP check (default --model; its heads must split over --tp ranks)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
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
    if args.warmup_flashinfer:
        return warmup_flashinfer(args)
    missing = flashinfer_status()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    log(
        f"torch {torch.__version__}, device {device_name}, dtype {args.dtype}, model {args.model}, "
        f"flashinfer {'available' if missing is None else 'MISSING (' + missing + ')'}"
    )
    if args.device.startswith("cuda") and missing is not None:
        print(
            "note: without flashinfer no CUDA graph is captured (the torch backend's plan is not capturable); "
            "the padded path runs eagerly instead"
        )
    report: dict = {
        "device": device_name,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "model": str(args.model),
        "flashinfer": missing or "available",
    }
    all_equal = True
    try:
        if not args.skip_equality and not args.tp_only:
            all_equal = check_equality(args, missing, report)
        if not args.skip_bench and not args.tp_only:
            bench_decode(args, report)
        if args.kv_capacity and not args.tp_only:
            report_kv_capacity(args, report)
        if args.tp > 1:
            all_equal &= check_tensor_parallel(args, report)
    except ValueError as exc:  # bad arguments for this model or pool
        print(f"error: {exc}")
        return 2
    finally:
        if args.json:
            report["all_equal"] = all_equal
            args.json.write_text(json.dumps(report, indent=1, default=str))
    print("RESULT: tokens equal" if all_equal else "RESULT: TOKEN MISMATCH")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
