"""`batchserve proc NAME`: run one of the five processes, as systemd (or `batchserve serve`) starts it.

Configuration: `--config FILE` (a `ServerConfig` as JSON, what `serve` writes), overridden by
`BATCHSERVE_*` environment variables, overridden by command-line flags.

A process that has run ends with `os._exit`, skipping the interpreter's teardown: by then it has
released what it owns (sockets flushed, shared memory unlinked, the device group left), and the
teardown's garbage collection over torch's and transformers' objects took seconds of CPU, past
10 s on a loaded machine, so a stopped server's processes were killed rather than exiting.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

import msgspec

from batchserve.procs.runtime import StopRequested
from batchserve.shared.config import ServerConfig, add_config_arguments, config_from_args
from batchserve.shared.logs import setup_logging
from batchserve.shared.process_messages import PROCESS_NAMES

# The processes: name -> module with `run(config: ServerConfig) -> int`, in start order.
PROCESSES: dict[str, str] = {name: f"batchserve.procs.{name}.process" for name in PROCESS_NAMES}
START_ORDER = PROCESS_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(PROCESSES), help="which process to run")
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="ServerConfig JSON (as written by `batchserve serve`); env and flags override it",
    )
    parser.add_argument(
        "--local-rank",
        type=int,
        default=0,
        metavar="I",
        help="worker only: which of this machine's tensor-parallel ranks to run (default 0; "
        "global rank = node_rank * tensor_parallel_size / nnodes + I)",
    )
    add_config_arguments(parser)


def load_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> ServerConfig:
    """File < `BATCHSERVE_*` environment < flags."""
    env = dict(os.environ) if env is None else env
    if not args.config:
        return config_from_args(args, env)
    try:
        base = ServerConfig.load(args.config)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {args.config} not found") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"config file {args.config}: {exc}") from None
    explicit = config_from_args(args, env)
    changed = {
        field.name: getattr(explicit, field.name)
        for field in msgspec.structs.fields(ServerConfig)
        if getattr(args, field.name, None) is not None or env.get(f"BATCHSERVE_{field.name.upper()}")
    }
    return msgspec.structs.replace(base, **changed)


def main(args: argparse.Namespace) -> NoReturn:
    """Run the process; a configuration error is raised for the CLI to print, any other end exits here."""
    config = load_config(args)
    setup_logging(config.log_format)
    module = importlib.import_module(PROCESSES[args.name])
    try:
        if args.name == "worker":
            status = int(module.run(config, args.local_rank) or 0)
        elif args.local_rank:
            raise ValueError(f"--local-rank is the worker's; the {args.name} process has no ranks")
        else:
            status = int(module.run(config) or 0)
    except StopRequested:  # stopped while starting: what it had opened was closed on the way out
        status = 0
    except (ValueError, FileNotFoundError):
        raise  # a configuration error: one line from the CLI, exit status 2 (systemd will not retry)
    except Exception:
        logging.getLogger(f"batchserve.{args.name}").exception("%s process failed", args.name)
        status = 1
    logging.getLogger("batchserve.process").info(
        "%s stopped", args.name, extra={"fields": {"pid": os.getpid(), "status": status}}
    )
    exit_now(status)


def exit_now(status: int) -> NoReturn:
    """Flush what is buffered (log handlers, stdout, stderr) and end the process without the
    interpreter's teardown (see the module docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be written to it
            pass
    os._exit(status)
