"""`batchserve generate`: one-shot offline generation, all prompts as one workload through the scheduler.

    batchserve generate --prompt "Hello" --prompt "Hi there" --max-tokens 32 --json
    batchserve generate --chat --prompts-file prompts.jsonl --temperature 0 --policy prefill-first
    batchserve generate --tp 2 --prompt "Hello"      # the model split over 2 worker ranks (processes)
    batchserve generate --speculative ngram --temperature 0 --prompt "Hello"

The engine flags are `serve`'s own (`shared.config.ENGINE_FIELDS`: every setting but the api's, the
replicas' and the processes'). With speculative decoding, stderr says how many proposed tokens were accepted.

With `--json`, one line per prompt, in order:
`{"prompt": ..., "token_ids": [...], "text": ..., "finish_reason": "stop"|"length"}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from batchserve.procs.cli import CliError
from batchserve.shared.checks import check_sampling as check_sampling_params
from batchserve.shared.config import ENGINE_FIELDS, add_config_arguments, config_from_args
from batchserve.shared.errors import Refusal

if TYPE_CHECKING:
    from batchserve.procs.engine import OfflineEngine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", type=Path, help="a file with one JSON string per line")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template (as a user message)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1: off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--stop-token-id", action="append", type=int, default=[], help="a stop token id (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    # Every engine setting `serve` takes, from the one list (shared.config.ENGINE_FIELDS).
    add_config_arguments(parser.add_argument_group("engine (as `batchserve serve` takes them)"), only=ENGINE_FIELDS)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise CliError(f"--prompts-file: no such file: {args.prompts_file}")
        for number, line in enumerate(args.prompts_file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CliError(f"--prompts-file line {number}: not JSON ({exc.msg})") from None
            if not isinstance(prompt, str):
                raise CliError(f"--prompts-file line {number}: expected a JSON string, got {type(prompt).__name__}")
            prompts.append(prompt)
    if not prompts:
        raise CliError("no prompts: give --prompt TEXT or --prompts-file FILE")
    if any(p == "" for p in prompts):
        raise CliError("a prompt is empty")
    return prompts


def check_sampling(args: argparse.Namespace) -> None:
    """The api's checks (`shared.checks`), naming the flags."""
    if args.max_tokens < 1:
        raise CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        check_sampling_params(args.temperature, args.top_p, args.top_k, args.min_p, args.seed, flag="--")
    except Refusal as exc:
        raise CliError(exc.message.replace("_", "-")) from None


def _say_speculation(engine: OfflineEngine) -> None:
    """With speculative decoding, one stderr line of what it did (stdout stays the completions)."""
    method = engine.config.speculative
    if method != "off":
        print(
            f"batchserve generate: speculative {method}: {engine.accepted_tokens} of {engine.draft_tokens} "
            f"proposed tokens accepted",
            file=sys.stderr,
        )


def main(args: argparse.Namespace) -> int:
    from batchserve.procs.engine import OfflineEngine, RankFailure, request

    prompts = read_prompts(args)
    check_sampling(args)
    config = config_from_args(args)
    sampling = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
    }
    stop = {
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
    }
    requests = [
        request(
            f"prompt-{i}",
            prompt=None if args.chat else p,
            messages=[{"role": "user", "content": p}] if args.chat else None,
            sampling=sampling,
            stop=stop,
        )
        for i, p in enumerate(prompts)
    ]
    try:
        with OfflineEngine(config) as engine:  # closing stops the other tensor-parallel ranks
            completions = engine.generate(requests)
            _say_speculation(engine)
    except Refusal as exc:
        raise CliError(f"{exc.param or 'prompt'}: {exc.message}") from None
    except RankFailure as exc:
        raise CliError(str(exc)) from None
    for prompt, completion in zip(prompts, completions):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "token_ids": completion.token_ids,
                        "text": completion.text,
                        "finish_reason": completion.finish_reason,
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(completion.text if len(prompts) == 1 else f"--- {prompt}\n{completion.text}")
    sys.stdout.flush()
    return 0
