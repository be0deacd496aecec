"""Short prompts behind a long one (issue 30's fairness): their time to first token, and the long
prompt's, for server variants started one after another in the same run.

Each round sends one long prompt (`--long-len` tokens), then, `--delay` seconds later while it is still
being prefilled, `--shorts` short prompts (`--short-len` tokens) at once; every request asks for
`--output-len` tokens. Rounds use fresh prompts (nothing is found in the prefix cache). Prints, per
variant, the median over rounds of the shorts' median and slowest TTFT and of the long prompt's TTFT,
and their ratios to the first variant.

    .venv/bin/python -m batchserve.loadtests.bench_long_prompt --variant 'fair=' \\
        --variant 'chapter=--no-fair-prefill' [--rounds 3] [--out loadtests/results/long_prompt_cpu.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchserve.loadtests.client import RequestResult, make_session, send_request
from batchserve.loadtests.metrics import ttft
from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, ServerProcess
from batchserve.loadtests.workload import RequestSpec, WordPromptBuilder


@dataclass
class Round:
    long_ttft_s: float
    short_ttfts_s: list[float]


async def _round(base_url: str, model: str, long_spec: RequestSpec, shorts: list[RequestSpec], delay_s: float) -> Round:
    async with make_session(600.0) as session:
        long_task = asyncio.create_task(send_request(session, base_url, "completions", model, long_spec))
        await asyncio.sleep(delay_s)
        short_results = await asyncio.gather(
            *(send_request(session, base_url, "completions", model, s) for s in shorts)
        )
        long_result = await long_task
    results: list[RequestResult] = [long_result, *short_results]
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:2]}")
    return Round(ttft(long_result), [ttft(r) for r in short_results])  # type: ignore[misc]


def _specs(rng: np.random.Generator, args: argparse.Namespace) -> tuple[RequestSpec, list[RequestSpec]]:
    words = WordPromptBuilder()
    long_spec = RequestSpec(words.build(rng, args.long_len), args.long_len, args.output_len)
    return long_spec, [
        RequestSpec(words.build(rng, args.short_len), args.short_len, args.output_len) for _ in range(args.shorts)
    ]


def _run_variant(name: str, flags: list[str], args: argparse.Namespace, log_dir: Path) -> list[Round]:
    command = [*DEFAULT_SERVE_COMMAND, *(["--model", args.model] if args.model else []), *flags]
    print(f"starting {name}: {shlex.join(flags) or '(defaults)'}", file=sys.stderr, flush=True)
    rng = np.random.default_rng(args.seed)  # every variant gets the same prompts
    rounds = []
    with ServerProcess(command, log_dir / f"server-{name}.log") as server:
        with urllib.request.urlopen(server.base_url + "/v1/models") as resp:
            model = json.load(resp)["data"][0]["id"]
        warm_long, warm_shorts = _specs(np.random.default_rng(args.seed + 1), args)
        asyncio.run(_round(server.base_url, model, warm_long, warm_shorts[:1], args.delay))  # warm up
        for _ in range(args.rounds):
            rounds.append(asyncio.run(_round(server.base_url, model, *_specs(rng, args), args.delay)))
    return rounds


def _summary(rounds: list[Round]) -> dict[str, float]:
    return {
        "shorts p50": statistics.median(statistics.median(r.short_ttfts_s) for r in rounds),
        "shorts max": statistics.median(max(r.short_ttfts_s) for r in rounds),
        "long": statistics.median(r.long_ttft_s for r in rounds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME=FLAGS",
        help="a server to measure: a name, then the serve flags (the first is the baseline)",
    )
    parser.add_argument("--model", default="", help="served model (default: the built-in default model)")
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--shorts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds between the long prompt and the shorts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    variants = []
    for text in args.variant:
        name, sep, flags = text.partition("=")
        if not sep or not name:
            parser.error(f"--variant: expected NAME=FLAGS, got {text!r}")
        variants.append((name, shlex.split(flags)))

    with tempfile.TemporaryDirectory() as tmp:
        summaries = {name: _summary(_run_variant(name, flags, args, Path(tmp))) for name, flags in variants}
    base = summaries[variants[0][0]]
    lines = [
        f"# {shlex.join(['python', '-m', 'batchserve.loadtests.bench_long_prompt', *(argv or sys.argv[1:])])}",
        f"# one {args.long_len}-token prompt, then {args.shorts} of {args.short_len} tokens {args.delay:g} s "
        f"later; {args.output_len} output tokens each; medians over {args.rounds} rounds; TTFT in ms",
        f"{'variant':<12}{'shorts p50':>12}{'shorts max':>12}{'long':>10}{'x shorts p50':>14}{'x long':>8}",
    ]
    for name, s in summaries.items():
        lines.append(
            f"{name:<12}{s['shorts p50'] * 1000:>12.0f}{s['shorts max'] * 1000:>12.0f}{s['long'] * 1000:>10.0f}"
            f"{s['shorts p50'] / base['shorts p50']:>13.2f}x{s['long'] / base['long']:>7.2f}x"
        )
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
