"""What flash-linear-attention's kernels need to run under Triton 3.7's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) on CPU tensors: test-side patches, never the server's. `install()` puts them in place, once,
before the first kernel runs; without the interpreter it does nothing.

- Autotuning: fla's kernels are `triton.autotune`d over several configs, which the autotuner times with the
  GPU driver's benchmarker (there is none: "0 active drivers"). Under the interpreter every config computes
  the same thing and timings mean nothing, so the benchmarker reports equal times without running anything,
  and the autotuner keeps the first config (`min` over equal timings), which then runs once.
- Loop counters: the interpreter runs a kernel as Python, its `range` / `tl.range` counters Python ints, but
  fla calls tensor methods on them (`i_t.to(tl.int64)` in the chunked form's state pass: "'int' object has
  no attribute 'to'"). The interpreter already rewrites each assignment's value into a tensor
  (`interpreter_semantic.to_tensor`, its AST pass); the patch makes that pass also do so for the counter
  of each `range(...)` / `tl.range(...)` loop, first thing in the body. `tl.static_range` counters stay
  ints (they may index Python tuples).

fla itself needs nothing more: with no GPU driver it warns "Triton is not supported on current platform, roll
back to CPU" at import and takes its no-GPU defaults (no TF32 in its dots, the smallest block configs, the
autocast decorators on "cuda", a no-op on CPU tensors); its wrappers then launch the same kernels.
"""

from __future__ import annotations

import ast
import os

_installed = False


def install() -> None:
    global _installed
    if _installed or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    Autotuner.do_bench = property(lambda self: _equal_timings)
    interpreter.ASTTransformer.visit_For = _counter_as_tensor
    interpreter.InterpretedFunction.rewritten_fn.clear()  # kernels rewritten before this: again, with the patch
    _installed = True


def _equal_timings(kernel_call, quantiles):
    return [0.0] * len(quantiles)


def _is_range(call: ast.expr) -> bool:
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    return (isinstance(func, ast.Name) and func.id == "range") or (
        isinstance(func, ast.Attribute) and func.attr == "range"
    )


def _counter_as_tensor(self: ast.NodeTransformer, node: ast.For) -> ast.For:
    self.generic_visit(node)
    if isinstance(node.target, ast.Name) and _is_range(node.iter):
        name = node.target.id
        to_tensor = ast.Attribute(ast.Name("interpreter_semantic", ast.Load()), "to_tensor", ast.Load())
        value = ast.Call(to_tensor, [ast.Name(name, ast.Load()), ast.Constant(False)], [])
        node.body.insert(0, ast.Assign([ast.Name(name, ast.Store())], value))
    return node
