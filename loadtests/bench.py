"""`batchserve bench`: measure an OpenAI-compatible endpoint, or (`--compare`) this server under each
scheduling policy plus the transformers static-batching baseline, on one workload in one run.

Reports completed/failed requests, request/s, input and output tokens/s, and mean/p50/p90/p99 of
TTFT, ITL, TPOT and end-to-end latency (definitions in `loadtests.metrics`), never throughput alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchserve.loadtests.report import RunRecord, format_ratios, format_table, format_turns, write_json
from batchserve.loadtests.runner import LoadPoint
from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND
from batchserve.loadtests.targets import Opener, Plan, measure_targets, server_target, transformers_target, url_target
from batchserve.loadtests.workload import (
    LengthRange,
    PromptBuilder,
    TokenizerPromptBuilder,
    WordPromptBuilder,
    chat_workload,
    editing_workload,
    multiturn_workload,
    questions_workload,
    random_workload,
    spread_over_models,
)
from batchserve.procs.cli import CliError
from batchserve.shared.commands import cli_command
from batchserve.shared.config import DEFAULT_MODEL, POLICIES, ServerConfig
from batchserve.shared.model import resolve_model
from batchserve.shared.slo import DEFAULT_SLOS, Slo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to measure (without --compare)")
    target.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model name sent in requests; with --compare "
        "also the model the servers and the transformers baseline load",
    )
    target.add_argument("--endpoint", choices=("completions", "chat"), default="chat")
    target.add_argument(
        "--spread-models",
        default="",
        help="comma list of model names (LoRA adapters, say): request i names the (i mod N)-th instead of --model",
    )
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    load = parser.add_argument_group("workload")
    load.add_argument(
        "--workload",
        choices=("random", "chat", "questions", "editing", "multiturn"),
        default="random",
        help="random: lengths from --input-len/--output-len; chat: a built-in chat-like mix; "
        "questions: everyday chat questions sent without max_tokens (answered until EOS), "
        "sampled at temperature 0.7 with a seed per request; editing: requests to rewrite a "
        "passage that the answer mostly repeats, greedy, ending at EOS (speculative "
        "decoding's case); multiturn: --num-prompts "
        "conversations of --turns questions behind one --system-tokens system prompt, each turn "
        "resending the history (chat endpoint; --concurrency = conversations in flight)",
    )
    load.add_argument("--turns", type=int, default=4, help="questions per conversation (multiturn)")
    load.add_argument("--system-tokens", type=int, default=1000, help="system prompt length (multiturn)")
    load.add_argument(
        "--num-prompts",
        default="100",
        help="requests per load point: one number, or a comma "
        "list with one entry per point (consecutive slices of one seeded workload: no point repeats "
        "another's prompts, which a prefix cache would answer)",
    )
    load.add_argument("--input-len", default="128:512", help="prompt tokens, N or MIN:MAX (random workload)")
    load.add_argument("--output-len", default="64:256", help="output tokens, N or MIN:MAX (random workload)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=2, help="requests sent before each measurement, not counted")
    load.add_argument(
        "--tokenizer",
        default="auto",
        help="auto: the model's tokenizer when it resolves, else "
        "words; words: a word list; or a tokenizer.json / model folder",
    )
    load.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every (target, load point) this many times, "
        "interleaved with the other targets in rotated order, each round with prompts of its own, "
        "and pool the results",
    )
    load.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="count requests meeting every objective, e.g. --goodput ttft:3000 tpot:150 (also e2el:MS), "
        "or a device's preset: cpu ("
        + DEFAULT_SLOS["cpu"].label()
        + ") or cuda ("
        + DEFAULT_SLOS["cuda"].label()
        + "); adds good %% and goodput (req/s) to every table",
    )
    load.add_argument("--concurrency", help="comma list, e.g. 1,8,32: requests kept in flight (default 8)")
    load.add_argument("--request-rate", help="comma list of requests/s (Poisson arrivals), inf allowed")
    load.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --concurrency: stream k starts k * SECONDS after the first (clients arriving one by one)",
    )

    comp = parser.add_argument_group("comparison")
    comp.add_argument(
        "--compare",
        action="store_true",
        help="start `batchserve serve` under each --policies entry (and --variant), and the "
        "transformers baseline; every load point measures each of them in turn, each started "
        "for its measurement and stopped after it",
    )
    comp.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma list of server policies to run (default: all, the server's default first)",
    )
    comp.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    comp.add_argument(
        "--compare-url",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="another running server to add to the table (repeatable)",
    )
    comp.add_argument("--compare-model", help="model name sent to --compare-url servers (default: --model)")
    comp.add_argument(
        "--max-batch-size",
        type=int,
        default=ServerConfig().max_running_requests,
        help="servers' --max-running-requests and the transformers batch size",
    )
    comp.add_argument("--server-args", default="", help="extra flags for every started server, one string")
    comp.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="a server per variant (and policy) with these extra flags, e.g. "
        "rho0.1='--kv-reserve-ratio 0.1' (repeatable)",
    )
    comp.add_argument(
        "--serve-command",
        default=shlex.join(DEFAULT_SERVE_COMMAND),
        help="command that starts a server; --model/--policy/--host/--port are appended",
    )
    comp.add_argument("--health-timeout", type=float, default=600.0, help="seconds to wait for /health")
    comp.add_argument("--baseline-device", default="auto", help="device of the transformers baseline")
    comp.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch CPU threads for the started servers "
        "(OMP_NUM_THREADS) and the transformers baseline alike; 0: torch's default",
    )
    comp.add_argument("--log-dir", type=Path, help="where server logs go (default: a temporary directory)")

    out = parser.add_argument_group("output")
    out.add_argument("--output", type=Path, help="write results as JSON")
    out.add_argument("--plot", type=Path, help="write a PNG of throughput, TTFT and ITL over the sweep")
    out.add_argument("--no-progress", action="store_true")


def parse_points(concurrency: str | None, request_rate: str | None, stagger_s: float = 0.0) -> list[LoadPoint]:
    if concurrency and request_rate:
        raise CliError("give --concurrency or --request-rate, not both")
    if stagger_s < 0 or (stagger_s and request_rate):
        raise CliError("--stagger takes seconds >= 0 and goes with --concurrency")
    if request_rate:
        try:
            rates = [float(v) for v in request_rate.split(",")]
        except ValueError:
            raise CliError(f"--request-rate: expected numbers separated by commas, got {request_rate!r}") from None
        if any(not r > 0 for r in rates):
            raise CliError(f"--request-rate: every rate must be > 0, got {request_rate!r}")
        return [LoadPoint(request_rate=r) for r in rates]
    try:
        levels = [int(v) for v in (concurrency or "8").split(",")]
    except ValueError:
        raise CliError(f"--concurrency: expected integers separated by commas, got {concurrency!r}") from None
    if any(c < 1 for c in levels):
        raise CliError(f"--concurrency: every level must be >= 1, got {concurrency!r}")
    return [LoadPoint(concurrency=c, stagger_s=stagger_s) for c in levels]


def parse_num_prompts(text: str, num_points: int) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise CliError(f"--num-prompts: expected integers separated by commas, got {text!r}") from None
    if any(c < 1 for c in counts):
        raise CliError(f"--num-prompts: every count must be >= 1, got {text!r}")
    if len(counts) == 1:
        return counts * num_points
    if len(counts) != num_points:
        raise CliError(f"--num-prompts: {len(counts)} counts for {num_points} load points")
    return counts


def resolve_model_dir(model: str) -> Path:
    """A Hugging Face model folder for `model`: a folder path as is, else through `shared.model.resolve_model`."""
    path = Path(model)
    return path if path.is_dir() else resolve_model(model)


def prompt_builder(choice: str, model: str, need_model: bool) -> tuple[PromptBuilder, str]:
    if choice == "words":
        return WordPromptBuilder(), "words"
    if choice != "auto":
        path = Path(choice)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise CliError(f"--tokenizer: no tokenizer.json at {choice!r}")
        return TokenizerPromptBuilder(path), str(path)
    try:
        tokenizer_json = resolve_model_dir(model) / "tokenizer.json"
    except Exception as exc:  # noqa: BLE001 - any resolver failure: fall back, unless the model is required anyway
        if need_model:
            raise
        print(f"bench: model {model!r} did not resolve ({exc}); prompts from a word list", file=sys.stderr)
        return WordPromptBuilder(), "words"
    if tokenizer_json.is_file():
        return TokenizerPromptBuilder(tokenizer_json), str(tokenizer_json)
    return WordPromptBuilder(), "words"


def _variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name or "/" in name:
        raise CliError(f"--variant: expected NAME=ARGS (a name without '/'), got {text!r}")
    try:
        return name, shlex.split(flags)
    except ValueError as exc:
        raise CliError(f"--variant {name}: {exc}") from None


def _named_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep:
        return text, text
    if not name or not url:
        raise CliError(f"--compare-url: expected [NAME=]URL, got {text!r}")
    return name, url


def main(args: argparse.Namespace) -> int:
    if args.torch_threads < 0:
        raise CliError(f"--torch-threads must be >= 0, got {args.torch_threads}")
    if args.rounds < 1:
        raise CliError(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup < 0:
        raise CliError(f"--warmup must be >= 0, got {args.warmup}")
    points = parse_points(args.concurrency, args.request_rate, args.stagger)
    counts = parse_num_prompts(args.num_prompts, len(points))
    num_prompts = sum(counts) * args.rounds  # each point and round its own prompts (Plan.specs_for)
    policies = [p for p in args.policies.split(",") if p] if args.compare else []
    if unknown := [p for p in policies if p not in POLICIES]:
        raise CliError(f"--policies: unknown {unknown}; choose from {list(POLICIES)}")
    with_transformers = args.compare and not args.no_transformers
    if with_transformers and args.workload in ("questions", "editing", "multiturn"):
        raise CliError(
            f"the {args.workload} workload cannot run on the transformers.generate baseline: add --no-transformers"
        )
    if args.workload == "multiturn" and (args.endpoint != "chat" or args.request_rate):
        raise CliError("the multiturn workload needs --endpoint chat and --concurrency (conversations in flight)")
    variants = [_variant(text) for text in args.variant]
    if variants and not args.compare:
        raise CliError("--variant needs --compare")
    builder, tokenizer_desc = prompt_builder(args.tokenizer, args.model, need_model=with_transformers)
    if args.workload == "chat":
        specs = chat_workload(num_prompts, args.seed, builder)
        warmup = chat_workload(args.warmup, args.seed + 1, builder) if args.warmup else []
    elif args.workload == "questions":
        specs = questions_workload(num_prompts, args.seed)
        warmup = questions_workload(args.warmup, args.seed + 1) if args.warmup else []
    elif args.workload == "editing":
        specs = editing_workload(num_prompts, args.seed)
        warmup = editing_workload(args.warmup, args.seed + 1) if args.warmup else []
    elif args.workload == "multiturn":
        output_len = LengthRange.parse(args.output_len, "--output-len").high
        specs = multiturn_workload(num_prompts, args.turns, args.system_tokens, output_len, args.seed, builder)
        # a warm-up that shares nothing with the conversations (it must not fill a prefix cache for them)
        warmup = (
            random_workload(args.warmup, LengthRange(16, 16), LengthRange(8, 8), args.seed + 1, builder)
            if args.warmup
            else []
        )
        counts = [c * args.turns for c in counts]  # --num-prompts counts conversations
    else:
        lens = (LengthRange.parse(args.input_len, "--input-len"), LengthRange.parse(args.output_len, "--output-len"))
        specs = random_workload(num_prompts, *lens, args.seed, builder)
        warmup = random_workload(args.warmup, *lens, args.seed + 1, builder) if args.warmup else []
    spread = [m for m in args.spread_models.split(",") if m]
    specs, warmup = spread_over_models(specs, spread), spread_over_models(warmup, spread)
    try:
        slo = Slo.parse(args.goodput) if args.goodput else None
    except ValueError as exc:
        raise CliError(f"--goodput: {exc}") from None
    plan = Plan(
        specs, warmup, points, args.seed, args.endpoint, args.request_timeout, not args.no_progress, counts, slo
    )

    endpoint = args.endpoint
    openers: list[tuple[str, Opener]] = []
    if not args.compare:
        openers.append(("server", functools.partial(url_target, args.base_url, args.model, endpoint)))
    else:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="batchserve-bench-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        for policy in policies:
            for name, extra in variants or [("", [])]:
                label = "/".join(part for part in (policy if len(policies) > 1 or not name else "", name) if part)
                openers.append(
                    (
                        label,
                        functools.partial(
                            server_target,
                            policy,
                            shlex.split(args.serve_command),
                            args.model,
                            args.max_batch_size,
                            [*shlex.split(args.server_args), *extra],
                            log_dir,
                            args.health_timeout,
                            endpoint,
                            args.torch_threads,
                            label,
                        ),
                    )
                )
    for text in args.compare_url:
        name, url = _named_url(text)
        openers.append((name, functools.partial(url_target, url, args.compare_model or args.model, endpoint)))
    if with_transformers:
        openers.append(
            (
                "transformers",
                functools.partial(
                    transformers_target,
                    resolve_model_dir(args.model),
                    args.max_batch_size,
                    args.baseline_device,
                    endpoint,
                    args.torch_threads,
                ),
            )
        )

    # SIGTERM unwinds like Ctrl-C, so the servers started for --compare are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    records, errors = measure_targets(openers, plan, args.rounds)
    if args.output:
        write_json(
            args.output, _workload_info(args, counts, tokenizer_desc, len(warmup)), records, _baselines(records), errors
        )
    baselines = _baselines(records)
    print("\n" + format_table(records))
    if turns := format_turns(records):
        print("\n" + turns)
    for baseline in baselines:
        print("\n" + format_ratios(records, baseline))
    if args.output:
        print(f"\nresults: {args.output}")
    if args.plot and records:
        from batchserve.loadtests.plot import plot_sweep

        plot_sweep(
            records,
            args.plot,
            title=f"{args.model}, {args.workload} workload, {args.num_prompts} prompts, {args.endpoint} endpoint",
        )
        print(f"plot: {args.plot}")
    if errors:
        return 2
    return 1 if any(r.metrics.completed == 0 for r in records) else 0


def _baselines(records: list[RunRecord]) -> list[str]:
    configs = {r.config for r in records}
    return [b for b in ("fixed", "transformers") if b in configs and len(configs) > 1]


def _workload_info(args: argparse.Namespace, counts: list[int], tokenizer_desc: str, num_warmup: int) -> dict[str, Any]:
    return {
        "workload": args.workload,
        "num_prompts": counts,
        "seed": args.seed,
        "input_len": args.input_len if args.workload == "random" else f"{args.workload} workload",
        "output_len": args.output_len
        if args.workload == "random"
        else ("until EOS (no max_tokens)" if args.workload == "questions" else "chat mix"),
        "variants": args.variant,
        "endpoint": args.endpoint,
        "model": args.model,
        "prompts_from": tokenizer_desc,
        "warmup": num_warmup,
        "max_batch_size": args.max_batch_size if args.compare else None,
        "server_args": args.server_args if args.compare else None,
        "torch_threads": args.torch_threads or None,
        "rounds": args.rounds,
        "goodput": Slo.parse(args.goodput).label() if args.goodput else None,  # a preset's values, not its name
        "command": shlex.join(["batchserve", *sys.argv[1:]]),
    }


def bench_once(url: str, args: argparse.Namespace, seed: int, output: Path, *extra: str) -> dict:
    """One `batchserve bench` run (a subprocess) against `url` with `args`' concurrency, num_prompts, input_len
    and output_len, and `extra` flags: its metrics (the benchmarks that alternate runs on one server use it)."""
    command = [
        *cli_command("bench"),
        "--base-url",
        url,
        "--model",
        DEFAULT_MODEL,
        "--concurrency",
        str(args.concurrency),
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--seed",
        str(seed),
        "--output",
        str(output),
        "--no-progress",
        *extra,
    ]
    subprocess.run(command, check=True, cwd=Path(__file__).parents[1], stdout=subprocess.DEVNULL)
    return json.loads(output.read_text())["runs"][0]["metrics"]
