"""The `batchserve` command: one subcommand per module, imported only when used.

Each subcommand module defines `add_arguments(parser)` and `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("batchserve.procs.serve", "start all five processes and serve the OpenAI-compatible API"),
    "proc": ("batchserve.procs.launch", "run one process (api, tokenizer, scheduler, worker, detokenizer)"),
    "router": (
        "batchserve.procs.router",
        "run the gateway (smg) in front of the replicas, as --router and --data-parallel-size say",
    ),
    "generate": ("batchserve.procs.generate", "one-shot offline generation for a batch of prompts"),
    "simulate": ("batchserve.procs.scheduler.simulate", "run a scheduling scenario through the real scheduler"),
    "bench": ("batchserve.loadtests.bench", "benchmark an OpenAI-compatible endpoint (TTFT, ITL, TPOT, throughput)"),
    "install-systemd": ("batchserve.procs.install_systemd", "write systemd units and env file for this virtualenv"),
}


class CliError(Exception):
    """A user error: printed as one line naming the problem, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve", description="A continuous-batching LLM server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    name = sys.argv[1] if len(sys.argv) > 1 else None
    for command, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(command, help=help_text, description=help_text)
        if command == name:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = ["batchserve", *argv]
    args = build_parser().parse_args()
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.main(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"batchserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
