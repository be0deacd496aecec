"""Triton launches recorded on CPU tensors and compiled for the H100 (sm_90) without a GPU (issue 69).

`recorded()` patches the interpreter's launch (`InterpretedFunction.run`) to note each kernel, the types of
its arguments and its compile-time constants (its run can be skipped: the compile check needs shapes, not
values, so real models' widths cost nothing). `compile_for_h100` hands the distinct launches to a fresh
interpreter without TRITON_INTERPRET (in it, `triton.jit` makes the real JITFunction), which compiles each
with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` through the ptxas inside the triton
wheel, and reports each variant's shared memory: an H100 gives a block at most 227 KiB.

Run as a script it is that second interpreter: launches as JSON on stdin, results as JSON on stdout.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

H100_SHARED_BYTES = 232448  # 227 KiB: an sm_90 block's most shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin)
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # launch options, not kernel arguments
_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
_TYPES |= {"int8": "i8", "uint8": "u8", "bool": "i1", "int16": "i16", "float64": "fp64"}


@dataclass
class Launch:
    module: str
    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)


def _type_of(value: Any) -> str:
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def launch_of(fn: Any, args: tuple, kwargs: dict) -> Launch:
    """The launch of plain function `fn` (a jitted kernel's body) with these arguments."""
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs and kwargs[k] is not None}
    kwargs = {k: v for k, v in kwargs.items() if k in inspect.signature(fn).parameters}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    signature, constexprs = {}, {}
    for name, param in inspect.signature(fn).parameters.items():
        value = bound.arguments.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = _type_of(value)
    return Launch(fn.__module__, fn.__qualname__, signature, constexprs, options)


@contextlib.contextmanager
def recorded(run: bool = True) -> Iterator[list[Launch]]:
    """Every interpreted launch inside the block, in order (`run=False`: noted, not run)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    original = InterpretedFunction.run

    def note(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.append(launch_of(self.fn, args, dict(kwargs)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs) if run else None

    InterpretedFunction.run = note
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def compile_for_h100(launches: list[Launch], timeout: float = 600) -> list[dict[str, Any]]:
    """Each distinct launch compiled for sm_90 in a fresh interpreter: [{name, shared, error}] (error None: built)."""
    distinct = list({launch.key: launch for launch in launches}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__],  # (its folder on sys.path: a test module's kernels import)
        input=json.dumps([asdict(launch) for launch in distinct]),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the sm_90 compile failed to run:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def _kernel(module: str, name: str) -> Any:
    """The JITFunction under `module.name` (autotune and heuristics wrappers unwrapped)."""
    import importlib

    from triton.runtime.jit import JITFunction

    kernel: Any = importlib.import_module(module)
    for part in name.split("."):
        kernel = getattr(kernel, part)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _compile(launch: dict[str, Any]) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result: dict[str, Any] = {"name": launch["name"], "constexprs": launch["constexprs"], "shared": None}
    try:
        source = ASTSource(_kernel(launch["module"], launch["name"]), launch["signature"], launch["constexprs"])
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
        result.update(shared=built.metadata.shared, error=None)
    except Exception as exc:  # reported per variant: the test names what failed
        result["error"] = f"{type(exc).__name__}: {str(exc)[-800:]}"
    return result


if __name__ == "__main__":
    json.dump([_compile(launch) for launch in json.load(sys.stdin)], sys.stdout)
