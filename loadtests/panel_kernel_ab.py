"""The CPU linear kernel (`kernels/csrc/panel_linear.c`) of the working tree against a git revision's, in
one process: both built with the flags `kernels.native` uses, called alternately on random weights of the
default model's shapes (every layer's four linear layers + the LM head, read cold from memory as a decode
step reads them), the fastest of `--rounds` runs each. Prints ms per pass, the ratio and whether both gave
the same bits. Only panel_linear.c comes from the revision; vec8.h from the working tree.

    .venv/bin/python -m loadtests.panel_kernel_ab [--base HEAD] [--rows 1,2,3,8,32] [--rounds 25]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels import native
from kernels.panel_linear import pack_panels
from shared.config import DEFAULT_MODEL
from shared.model import read_model_json, resolve_model

ROOT = Path(__file__).resolve().parent.parent


def build(cc: str, source: str, out_dir: Path, name: str) -> ctypes.CDLL:
    (out_dir / "vec8.h").write_text((native.SOURCE_DIR / "vec8.h").read_text())
    (out_dir / f"{name}.c").write_text(source)
    library = out_dir / f"{name}.so"
    subprocess.run([cc, *native.BASE_FLAGS, "-fopenmp", str(out_dir / f"{name}.c"), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    for fn in ("f32_linear", "int8_linear"):  # the signatures kernels.native declares
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = native.SIGNATURES[fn]
    return lib


def shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of `model` and its LM head."""
    config = read_model_json(resolve_model(model))
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    layer = [(heads * head_dim + 2 * kv, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def one_pass(lib: ctypes.CDLL, weights, x: torch.Tensor, rows: int, outs: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for w, y in zip(weights, outs):
        k = w.packed.shape[1]
        if w.scale is not None:
            lib.int8_linear(x.data_ptr(), rows, k, w.packed.data_ptr(), w.scale.data_ptr(), None, w.out_features, k,
                            y.data_ptr())
        else:
            lib.f32_linear(x.data_ptr(), rows, k, w.packed.data_ptr(), None, w.out_features, k, y.data_ptr())
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision whose panel_linear.c is the baseline")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", default="1,2,3,8,32", help="tokens per call (a decode step's batch)")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    cc = native.compiler()
    if cc is None:
        parser.error("no C compiler found (set CC)")
    base_source = subprocess.run(["git", "show", f"{args.base}:kernels/csrc/panel_linear.c"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(cc, base_source, Path(tmp), "base"),
                "tree": build(cc, (native.SOURCE_DIR / "panel_linear.c").read_text(), Path(tmp), "tree")}
        torch.manual_seed(0)
        dims = shapes(args.model)
        print(f"panel_linear.c: working tree vs {args.base}; {len(dims)} weights of {args.model}'s shapes, "
              f"{torch.get_num_threads()} threads, fastest of {args.rounds} alternating passes")
        print(f"  {'weights':>7} {'rows':>4} {'base ms':>9} {'tree ms':>9} {'ratio':>7}  same bits")
        for quantization in ("int8", "none"):
            weights = [pack_panels(torch.randn(out, k) * 0.05, quantization) for out, k in dims]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, max(k for _, k in dims))
                outs = {name: [torch.empty(rows, w.out_features) for w in weights] for name in libs}
                best = {name: float("inf") for name in libs}
                for _ in range(args.rounds):
                    for name, lib in libs.items():
                        best[name] = min(best[name], one_pass(lib, weights, x, rows, outs[name]))
                same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"]))
                label = "fp32" if quantization == "none" else quantization
                print(f"  {label:>7} {rows:>4} {best['base'] * 1e3:>9.2f} {best['tree'] * 1e3:>9.2f} "
                      f"{best['base'] / best['tree']:>6.2f}x  {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
