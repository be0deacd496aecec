"""Engine-level benchmark: this worker's ModelRunner against `transformers.generate`, same weights,
same prompts, same process, same threads.

Prints decode tokens/s at several batch sizes, prefill tokens/s for 512-token prompts, the ratio,
where a decode step's time goes (attention, linear layers, LM head, sampling, other torch ops,
Python/dispatch overhead), and what a decode step costs with each per-request logits feature on
every row (penalties, logit_bias + min_tokens, logprobs) against the plain step and the bare step
(forward + sample, as the step was before per-slot logits state existed).

    .venv/bin/python -m batchserve.loadtests.bench_engine [--batch-sizes 1,8,32,64] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import contextlib
import time
import unittest.mock
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from llguidance import LLMatcher

from batchserve.kernels import native
from batchserve.kernels.panel_linear import PanelWeight
from batchserve.kernels.sampling import sample_batch
from batchserve.procs.tokenizer.grammars import JSON_OPTIONS
from batchserve.procs.worker import model_runner
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.models import layers
from batchserve.procs.worker.models.moe import SparseMoeBlock
from batchserve.procs.worker.step_probe import GREEDY
from batchserve.shared.config import DEFAULT_MODEL, QUANTIZATIONS
from batchserve.shared.gguf_convert import transformers_source
from batchserve.shared.messages import ForwardBatch, LogitsParams, RequestParams, SlotStart, StepResult
from batchserve.shared.model import resolve_model


class StaticPlan:
    """Pages for a fixed set of requests, handed out up front; builds prefill and decode batches."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], new_tokens: int):
        page_size = runner.page_size
        self.runner = runner
        self.prompts = prompts
        self.lens = [len(p) for p in prompts]
        next_page = 1
        self.pages: list[list[int]] = []
        for prompt in prompts:
            count = -(-(len(prompt) + new_tokens) // page_size)
            self.pages.append(list(range(next_page, next_page + count)))
            next_page += count
        if next_page > runner.kv_cache.num_pages:
            raise ValueError("KV pool too small for this benchmark")
        self.step = 0

    def _loc(self, i: int, pos: int) -> int:
        page_size = self.runner.page_size
        return self.pages[i][pos // page_size] * page_size + pos % page_size

    def _batch(self, tokens: list[list[int]], prefix: list[int], with_pages: bool) -> ForwardBatch:
        n = len(tokens)

        def i32(xs: list[int]) -> np.ndarray:
            return np.asarray(xs, dtype=np.int32)

        slots = [i for i in range(n) for _ in self.pages[i]] if with_pages else []
        cols = [c for i in range(n) for c in range(len(self.pages[i]))] if with_pages else []
        pages = [p for i in range(n) for p in self.pages[i]] if with_pages else []
        self.step += 1
        return ForwardBatch(
            step=self.step,
            slots=list(range(n)),
            prefix_lens=prefix,
            extend_lens=[len(t) for t in tokens],
            sample_lens=[1] * n,
            sampling=[GREEDY] * n,
            sample_counts=[0] * n,
            input_ids=i32([t for ts in tokens for t in ts]),
            positions=i32([prefix[i] + j for i, ts in enumerate(tokens) for j in range(len(ts))]),
            kv_locs=i32([self._loc(i, prefix[i] + j) for i, ts in enumerate(tokens) for j in range(len(ts))]),
            page_table_slots=i32(slots),
            page_table_cols=i32(cols),
            page_table_pages=i32(pages),
        )

    def prefill(self, logits: LogitsParams | None = None) -> ForwardBatch:
        batch = self._batch(self.prompts, [0] * len(self.prompts), with_pages=True)
        params = RequestParams(logits=logits or LogitsParams())
        batch.slot_starts = [
            SlotStart(slot=i, params=params, prompt_ids=p, min_tokens_banned=[0]) for i, p in enumerate(self.prompts)
        ]
        return batch

    def decode(self, last: list[int]) -> ForwardBatch:
        batch = self._batch([[t] for t in last], list(self.lens), with_pages=False)
        self.lens = [n + 1 for n in self.lens]
        return batch


def run_engine(
    runner: ModelRunner,
    prompts: list[list[int]],
    steps: int,
    around_decode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    logits: LogitsParams | None = None,
    execute: Callable[[ForwardBatch], StepResult] | None = None,
) -> tuple[float, float, list[list[int]]]:
    """(prefill seconds, seconds for `steps` decode steps, generated tokens); every request with
    `logits`, every decode step run by `execute` (default: the runner's)."""
    plan = StaticPlan(runner, prompts, steps + 1)
    started = time.perf_counter()
    last = runner.execute(plan.prefill(logits)).next_token_ids.tolist()
    prefill_s = time.perf_counter() - started
    outputs = [[t] for t in last]
    execute = execute or runner.execute
    with around_decode():
        started = time.perf_counter()
        for _ in range(steps):
            last = execute(plan.decode(last)).next_token_ids.tolist()
            for out, token in zip(outputs, last):
                out.append(token)
        decode_s = time.perf_counter() - started
    return prefill_s, decode_s, outputs


class _StepClock:
    """A logits processor that only timestamps each generate step (it leaves the scores alone)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_transformers(model, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
    """Same measure for `generate` (equal-length prompts, so no padding): prefill = start to the first
    step's logits, decode = first step's logits to the last's (`steps` forward passes)."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts)
    clock = _StepClock()
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            logits_processor=LogitsProcessorList([clock]),
        )
    return clock.times[0] - started, clock.times[-1] - clock.times[0], out[:, ids.shape[1] :].tolist()


Run = Callable[[], tuple[float, float, list[list[int]]]]


def same_greedy_tokens(ours: list[int], theirs: list[int], eos_ids: tuple[int, ...]) -> bool:
    """The same tokens, up to where the engine picks EOS: `generate`'s min_new_tokens (which keeps every
    row decoding for the timing) bans EOS there and takes the runner-up; the engine does not ban it."""
    stop = next((i for i, token in enumerate(ours) if token in eos_ids), len(ours))
    return ours[:stop] == theirs[:stop]


def alternating(repeats: int, ours: Run, theirs: Run | None):
    """Run both `repeats` times, alternating, and keep each side's fastest prefill and decode: the CPU
    may be shared with other work, which only ever slows a run down, and alternating spreads it."""
    results: tuple[list, list] = ([], [])
    for _ in range(repeats):
        results[0].append(ours())
        if theirs is not None:
            results[1].append(theirs())

    def best(rs: list) -> tuple | None:
        return (min(r[0] for r in rs), min(r[1] for r in rs), rs[0][2]) if rs else None

    return best(results[0]), best(results[1])


# ---------------------------------------------------------------------------------------------
# Where a decode step's time goes


class Timers:
    """Wall time per named part. A timed call inside another (the LM head's own `linear`) belongs
    to the outer part, so no time is counted twice."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._timing = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self._timing:
                return fn(*args, **kwargs)
            self._timing = True
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self._timing = False

        return timed


@contextlib.contextmanager
def instrumented(runner: ModelRunner, timers: Timers) -> Iterator[None]:
    attention, model = runner.attention, runner.model
    saved = (attention.forward, model.lm_head_logits, model_runner.sample_batch, layers.linear, SparseMoeBlock.__call__)
    attention.forward = timers.wrap(f"attention (KV write + attend, {attention.name} backend)", attention.forward)
    model.lm_head_logits = timers.wrap("LM head", model.lm_head_logits)
    model_runner.sample_batch = timers.wrap("sampling", model_runner.sample_batch)
    layers.linear = timers.wrap("linear layers (qkv, o, gate_up, down)", layers.linear)
    SparseMoeBlock.__call__ = timers.wrap("mixture of experts (router, top-k, experts)", SparseMoeBlock.__call__)
    try:
        yield
    finally:
        (attention.forward, model.lm_head_logits, model_runner.sample_batch, layers.linear, SparseMoeBlock.__call__) = (
            saved
        )


def decode_breakdown(runner: ModelRunner, prompts: list[list[int]], steps: int) -> None:
    timers, kernel_timers = Timers(), Timers()
    with c_kernels_timed(kernel_timers):  # C kernel calls, timed on their own (they nest inside the parts)
        _, decode_s, _ = run_engine(runner, prompts, steps, lambda: instrumented(runner, timers))
    step_ms = decode_s / steps * 1000
    parts = {k: v / steps * 1000 for k, v in timers.seconds.items()}
    c_share = min(sum(kernel_timers.seconds.values()) / decode_s, 1.0)
    # Time inside torch ops, from a second run under the profiler (which slows Python, not ops).
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    _, prof_decode_s, _ = run_engine(runner, prompts, steps, lambda: profiler)
    ops = [e for e in profiler.key_averages() if e.key.startswith(("aten::", "mkldnn::"))]
    op_share = min(sum(e.self_cpu_time_total for e in ops) / 1e6 / prof_decode_s, 1.0)
    print(f"  batch {len(prompts)}: decode step {step_ms:.1f} ms")
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"    {name:<52} {ms:7.1f} ms  {100 * ms / step_ms:5.1f}%")
    rest = step_ms - sum(parts.values())
    print(
        f"    {'rest: norms, rotary, SiLU, embedding, adds, python':<52} {rest:7.1f} ms  {100 * rest / step_ms:5.1f}%"
    )
    # Two runs, two shares that overlap a little (a C kernel call's Python wrapper allocates its output
    # with a torch op) and leave Python, dispatch and batch building as roughly the rest.
    print(
        f"    (torch ops {100 * op_share:.0f}% of a profiled step; C kernel calls, wrappers included, "
        f"{100 * c_share:.0f}% of an unprofiled one)"
    )


@contextlib.contextmanager
def c_kernels_timed(timers: Timers) -> Iterator[None]:
    """Time every call into `kernels.native`'s C kernels (callers look them up on the module)."""
    names = ("paged_decode_attention", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "write_kv", "argmax_rows")
    saved = {name: getattr(native, name) for name in names}
    for name, fn in saved.items():
        setattr(native, name, timers.wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(native, name, fn)


# ---------------------------------------------------------------------------------------------
# What the per-request logits features cost a decode step

FEATURES = {
    "plain": None,
    "penalties (frequency, presence, repetition)": LogitsParams(
        frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1
    ),
    "frequency + presence penalties": LogitsParams(frequency_penalty=0.5, presence_penalty=0.5),
    "logit_bias (8 ids) + min_tokens": LogitsParams(logit_bias={i: 1.0 for i in range(100, 108)}, min_tokens=10**6),
    "logprobs, top 5": LogitsParams(logprobs=5),
    # structured output: a JSON schema whose first string is long enough that no row completes
    "json_schema grammar": LogitsParams(
        grammar=LLMatcher.grammar_from_json_schema(
            {
                "type": "object",
                "required": ["name", "age"],
                "additionalProperties": False,
                "properties": {"name": {"type": "string", "minLength": 200}, "age": {"type": "integer"}},
            },
            defaults=JSON_OPTIONS,
        )
    ),
}


def bare_execute(runner: ModelRunner) -> Callable[[ForwardBatch], StepResult]:
    """The decode step as it was before per-slot logits state: checks, page table, forward, sample."""

    def execute(batch: ForwardBatch) -> StepResult:
        runner._check(batch)
        runner.kv_cache.apply_page_table_updates(batch.page_table_slots, batch.page_table_cols, batch.page_table_pages)
        with torch.inference_mode():
            logits = runner.forward_logits(batch)
            token_ids = sample_batch(logits, batch.sampling, batch.sample_counts)
        return StepResult(step=batch.step, next_token_ids=token_ids.to(torch.int32).numpy())

    return execute


def feature_costs(runner: ModelRunner, prompts: list[list[int]], steps: int, repeats: int) -> None:
    """Decode step time per feature, all variants alternating, best of `repeats` each."""
    variants: dict[str, Run] = {
        "bare step (before)": lambda: run_engine(runner, prompts, steps, execute=bare_execute(runner))
    }
    for name, logits in FEATURES.items():
        variants[name] = lambda logits=logits: run_engine(runner, prompts, steps, logits=logits)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, run in variants.items():
            best[name] = min(best.get(name, float("inf")), run()[1])
    plain = best["plain"]
    print(f"  batch {len(prompts)}:")
    for name, seconds in best.items():
        print(f"    {name:<46} {seconds / steps * 1000:7.2f} ms/step  {seconds / plain:5.3f}x plain")


# ---------------------------------------------------------------------------------------------


def linear_paths(
    runner: ModelRunner,
    model_dir: Path,
    prompts_for: Callable[[int, int], list[list[int]]],
    batch_sizes: list[int],
    args: argparse.Namespace,
) -> None:
    """Decode and prefill tokens/s of `runner` (panels) against the same model on oneDNN's layout."""
    with unittest.mock.patch.object(native, "available", lambda: False):  # only while the weights are packed
        onednn = ModelRunner(
            model_dir,
            device="cpu",
            dtype="float32",
            kv_capacity_tokens=runner.kv_capacity_tokens,
            max_running_requests=runner.max_running_requests,
            max_context=runner.max_context,
        )
    assert not isinstance(onednn.model.layers[0].qkv.weight, PanelWeight)
    assert isinstance(runner.model.layers[0].qkv.weight, PanelWeight)
    run_engine(onednn, prompts_for(2, 16), 2)
    print(
        f"\nlinear layers on the C panel kernel vs oneDNN's packed sgemm (greedy; best of {args.repeats} "
        f"alternating runs; tokens/s)"
    )
    print(f"  {'':>18} {'panels':>8} {'oneDNN':>8} {'ratio':>7}  same tokens")
    cases = [(f"decode batch {b}", prompts_for(b, args.prompt_len), args.decode_steps, 1) for b in batch_sizes]
    cases += [
        (f"prefill {n} x {args.prefill_len}", prompts_for(n, args.prefill_len), 1, 0)
        for n in (int(b) for b in args.prefill_batches.split(","))
    ]
    for name, prompts, steps, part in cases:
        ours, theirs = alternating(
            args.repeats,
            lambda prompts=prompts, steps=steps: run_engine(runner, prompts, steps),
            lambda prompts=prompts, steps=steps: run_engine(onednn, prompts, steps),
        )
        tokens = len(prompts) * (steps if part else len(prompts[0]))
        same = sum(o == t for o, t in zip(ours[2], theirs[2]))
        print(
            f"  {name:>18} {tokens / ours[part]:>8.1f} {tokens / theirs[part]:>8.1f} "
            f"{theirs[part] / ours[part]:>6.2f}x  {same}/{len(prompts)}",
            flush=True,
        )


@contextlib.contextmanager
def layers_fused(runner: ModelRunner, fused: bool) -> Iterator[None]:
    """Decode-only steps with every layer in one C call (`kernels.decode_layers`) or through the Python loop."""
    saved = runner.model.fuse_decode_layers
    runner.model.fuse_decode_layers = fused
    try:
        yield
    finally:
        runner.model.fuse_decode_layers = saved


def decode_layer_paths(
    runner: ModelRunner,
    prompts_for: Callable[[int, int], list[list[int]]],
    batch_sizes: list[int],
    args: argparse.Namespace,
) -> None:
    """Decode tokens/s with the layers in one C call per step against the per-op Python loop."""
    if not runner.model.fuse_decode_layers:
        raise SystemExit(
            "this model's decode steps do not run as one C call here (C kernels, panel weights, no q/k norm)"
        )

    def run(prompts: list[list[int]], fused: bool) -> Run:
        def timed():
            with layers_fused(runner, fused):
                return run_engine(runner, prompts, args.decode_steps)

        return timed

    print(
        f"\ndecode: every layer in one C call vs the per-op Python loop (greedy; best of {args.repeats} "
        f"alternating runs)"
    )
    print(f"  {'batch':>5} {'one call':>9} {'loop':>9} {'ratio':>7} {'ms/step saved':>14}  same tokens")
    for b in batch_sizes:
        prompts = prompts_for(b, args.prompt_len)
        fused, loop = alternating(args.repeats, run(prompts, True), run(prompts, False))
        saved_ms = (loop[1] - fused[1]) / args.decode_steps * 1000
        same = sum(f == o for f, o in zip(fused[2], loop[2]))
        print(
            f"  {b:>5} {b * args.decode_steps / fused[1]:>9.1f} {b * args.decode_steps / loop[1]:>9.1f} "
            f"{loop[1] / fused[1]:>6.2f}x {saved_ms:>14.2f}  {same}/{b}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request for decode runs")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-batches", default="1,4", help="numbers of prefill-len prompts prefilled at once")
    parser.add_argument("--breakdown-batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest counts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--quantization", default="auto", choices=QUANTIZATIONS, help="the engine's weights: auto, none or int8"
    )
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--feature-batches", default="1,32", help="batch sizes for the logits-feature costs")
    parser.add_argument("--only-features", action="store_true", help="measure only the logits-feature costs")
    parser.add_argument(
        "--only-linear",
        action="store_true",
        help="measure only decode and prefill with the linear layers on the C panel kernel "
        "against oneDNN's packed sgemm (the path without the C kernels)",
    )
    parser.add_argument("--only-decode", action="store_true", help="measure only decode tokens/s")
    parser.add_argument(
        "--only-decode-layers",
        action="store_true",
        help="measure only decode with every layer in one C call against the per-op Python loop",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prefill_batches = [int(b) for b in args.prefill_batches.split(",")]
    breakdown_batches = [int(b) for b in args.breakdown_batches.split(",")]
    feature_batches = [int(b) for b in args.feature_batches.split(",")]
    decode_batch = max(batch_sizes + breakdown_batches + feature_batches + [2])  # 2: the warm-up

    model_dir = resolve_model(args.model)
    capacity = max(
        decode_batch * (args.prompt_len + args.decode_steps + 32), max(prefill_batches) * (args.prefill_len + 32)
    )
    runner = ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        kv_capacity_tokens=capacity,
        max_running_requests=max(decode_batch, max(prefill_batches)),
        max_context=max(args.prompt_len + args.decode_steps, args.prefill_len) + 64,
        quantization=args.quantization,
    )
    reference = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        source, kwargs = transformers_source(model_dir)
        reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs).eval()
    rng = np.random.default_rng(0)

    def prompts_for(b: int, n: int) -> list[list[int]]:
        return rng.integers(100, runner.vocab_size, size=(b, n)).tolist()

    weights = "fp32" if args.quantization in ("auto", "none") else args.quantization
    print(
        f"model {args.model} ({model_dir}), {weights} weights, CPU, torch threads {torch.get_num_threads()}, "
        f"prompt {args.prompt_len} tokens, {args.decode_steps} decode steps"
    )

    # warm-up both (first calls allocate and pick kernels)
    warm = prompts_for(2, 16)
    run_engine(runner, warm, 2)
    if reference is not None:
        run_transformers(reference, warm, 2)

    if args.only_linear:
        linear_paths(runner, model_dir, prompts_for, batch_sizes, args)
        return 0
    if args.only_decode_layers:
        decode_layer_paths(runner, prompts_for, batch_sizes, args)
        return 0

    if not args.only_decode:
        print(
            f"\ndecode step with per-request logits features on every row (greedy; best of {args.repeats} "
            f"alternating runs)"
        )
        for b in feature_batches:
            feature_costs(runner, prompts_for(b, args.prompt_len), args.decode_steps, args.repeats)
        if args.only_features:
            return 0

    print(f"\ndecode tokens/s (batch of equal-length prompts, greedy; best of {args.repeats} alternating runs)")
    print(
        f"  {'batch':>5} {'engine':>10} {'transformers':>13} {'ratio':>7}  {'same tokens':>11}"
        "  (up to the engine's EOS)"
    )
    for b in batch_sizes:
        prompts = prompts_for(b, args.prompt_len)
        ours, theirs = alternating(
            args.repeats,
            lambda prompts=prompts: run_engine(runner, prompts, args.decode_steps),
            None
            if reference is None
            else lambda prompts=prompts: run_transformers(reference, prompts, args.decode_steps),
        )
        ours_tps = b * args.decode_steps / ours[1]
        if theirs is None:
            print(f"  {b:>5} {ours_tps:>10.1f}")
            continue
        theirs_tps = b * args.decode_steps / theirs[1]
        same = sum(same_greedy_tokens(o, t, runner.eos_token_ids) for o, t in zip(ours[2], theirs[2]))
        print(
            f"  {b:>5} {ours_tps:>10.1f} {theirs_tps:>13.1f} {ours_tps / theirs_tps:>6.2f}x  {same:>5}/{b:<5}",
            flush=True,
        )
    if args.only_decode:
        return 0

    print(f"\nprefill tokens/s ({args.prefill_len}-token prompts)")
    print(f"  {'prompts':>7} {'engine':>10} {'transformers':>13} {'ratio':>7}")
    for b in prefill_batches:
        prompts = prompts_for(b, args.prefill_len)
        ours, theirs = alternating(
            args.repeats,
            lambda prompts=prompts: run_engine(runner, prompts, 0),
            None if reference is None else lambda prompts=prompts: run_transformers(reference, prompts, 0),
        )
        ours_tps = b * args.prefill_len / ours[0]
        if theirs is None:
            print(f"  {b:>7} {ours_tps:>10.1f}")
            continue
        theirs_tps = b * args.prefill_len / theirs[0]
        print(f"  {b:>7} {ours_tps:>10.1f} {theirs_tps:>13.1f} {ours_tps / theirs_tps:>6.2f}x", flush=True)

    print("\nwhere an engine decode step goes (the per-op Python loop, so that each op can be timed; a step")
    print("runs every layer in one C call instead, which saves the Python part of `rest`: --only-decode-layers)")
    with layers_fused(runner, False):
        for b in breakdown_batches:
            decode_breakdown(runner, prompts_for(b, args.prompt_len), args.decode_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
