"""How one batchserve process starts another: `python -P -m batchserve.<module>`.

`-P` keeps the working directory off the child's sys.path. Started from a checkout of this repository,
the child would otherwise find the checkout's own folders (`kernels/`, `shared/`) as the top-level
packages of those names, shadowing installed ones such as Hugging Face's `kernels`, which transformers
imports.
"""

from __future__ import annotations

import sys


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs `module` (a dotted name) with this interpreter and `args`."""
    return [sys.executable, "-P", "-m", module, *args]


def cli_command(*args: str) -> list[str]:
    """`batchserve ARGS` as a module run (the same interpreter, no console script needed)."""
    return module_command("batchserve.procs.cli", *args)
