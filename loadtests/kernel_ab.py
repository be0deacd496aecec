"""A CPU kernel of the working tree against a git revision's, in one process: both built with the flags
`kernels.native` uses, called alternately on the same inputs, the fastest of `--rounds` runs each. Prints
ms per pass, the ratio and whether both gave the same bits. Only the kernel's .c file comes from the
revision; vec8.h from the working tree.

- `linear` (`kernels/csrc/panel_linear.c`): random weights of the default model's shapes, every layer's
  four linear layers + the LM head, read cold from memory as a decode step reads them; `--rows` tokens.
- `blocks` (`kernels/csrc/quant_*.c`, with panel_linear.c for the tiles): GGUF block weights of the 1B Llama's
  shapes (`loadtests/bench_gguf_model.py`'s llama-1b: 4 layers' and the LM head), Q4_K with Q6_K heads as in
  a Q4_K_M file, and Q8_0; `--rows` tokens.
- `attention` (`kernels/csrc/paged_decode_attention.c`): one decode step's attention over every layer,
  the default model's heads, `--rows` requests of about `--context` cached tokens each, in pages
  scattered over a pool of the server's size (as a running server's allocator leaves them).

    .venv/bin/python -m batchserve.loadtests.kernel_ab linear [--base HEAD] [--rows 1,2,3,8,32] [--rounds 25]
    .venv/bin/python -m batchserve.loadtests.kernel_ab blocks [--base HEAD] [--rows 1,4,16]
    .venv/bin/python -m batchserve.loadtests.kernel_ab attention [--base HEAD] [--rows 1,16,32] [--context 400]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchserve.kernels import native
from batchserve.kernels.panel_linear import pack_panels
from batchserve.procs.worker.loader import load_model_config
from batchserve.procs.worker.models.base import ModelConfig
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.model import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
QUANT_SOURCES = ("quant_linear.c", "quant_legacy.c", "quant_kquants.c", "panel_linear.c")
SOURCES = {
    "linear": (("panel_linear.c",), ("f32_linear", "int8_linear")),
    "blocks": (QUANT_SOURCES, ("block_linear",)),
    "attention": (("paged_decode_attention.c",), ("paged_decode_attention",)),
}
POOL_TOKENS = 23280  # the default model's KV capacity on a 24 GiB CPU server
PAGE_SIZE = 16
BLOCK_VOCAB = 49152  # SmolLM2's tokenizer's, which the 1B Llama borrows
BLOCK_LAYERS = 4  # of the 1B Llama's 16 layers in a `blocks` pass (with the head: ~70 MB of Q4_K, past the caches)

Pass = Callable[[ctypes.CDLL], float]  # one timed pass of a kernel build over prepared inputs
LayerCall = Callable[[ctypes.CDLL, Any, torch.Tensor, torch.Tensor], None]  # lib, weight, x, y: y = x @ weight.T


def build(cc: str, sources: dict[str, str], out_dir: Path, name: str, functions: tuple[str, ...]) -> ctypes.CDLL:
    """One library of `sources` (file name -> text) beside the working tree's headers."""
    for header in native.SOURCE_DIR.glob("*.h"):
        (out_dir / header.name).write_text(header.read_text())
    paths = []
    for file, text in sources.items():
        paths.append(out_dir / f"{name}_{file}")
        paths[-1].write_text(text)
    library = out_dir / f"{name}.so"
    subprocess.run([cc, *native.BASE_FLAGS, "-fopenmp", *map(str, paths), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    for fn in functions:  # the signatures kernels.native declares
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = native.SIGNATURES[fn]
    return lib


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every linear layer and the LM head."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer * config.num_layers + [(config.vocab_size, hidden)]


def layer_cases(
    label: str, weights: list[Any], width: int, args: argparse.Namespace, call: LayerCall
) -> list[tuple[str, Pass, Callable[[], object]]]:
    """(label, timed pass, its output) at every row count of `--rows`: a pass calls `call` for each weight."""
    cases = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, width)
        outs = [torch.empty(rows, w.out_features) for w in weights]

        def one_pass(lib: ctypes.CDLL, x=x, outs=outs) -> float:
            started = time.perf_counter()
            for w, y in zip(weights, outs):
                call(lib, w, x, y)
            return time.perf_counter() - started

        cases.append((f"{label}, {rows} rows", one_pass, lambda outs=outs: [y.clone() for y in outs]))
    return cases


def panel_call(lib: ctypes.CDLL, w: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    rows, k = x.shape[0], w.packed.shape[1]
    if w.scale is not None:
        lib.int8_linear(
            x.data_ptr(), rows, k, w.packed.data_ptr(), w.scale.data_ptr(), None, w.out_features, k, y.data_ptr()
        )
    else:
        lib.f32_linear(x.data_ptr(), rows, k, w.packed.data_ptr(), None, w.out_features, k, y.data_ptr())


def block_call(lib: ctypes.CDLL, w: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    n, k = w.shape
    lib.block_linear(x.data_ptr(), x.shape[0], x.shape[1], w.data.data_ptr(), w.kind.id, None, n, k, y.data_ptr())


def linear_cases(config: ModelConfig, args: argparse.Namespace) -> list[tuple[str, Pass, Callable[[], object]]]:
    """(label, timed pass, its output) for int8 and fp32 weights at every row count."""
    dims = linear_shapes(config)
    cases = []
    for quantization in ("int8", "none"):
        weights = [pack_panels(torch.randn(out, k) * 0.05, quantization) for out, k in dims]
        label = f"{'fp32' if quantization == 'none' else quantization} weights"
        cases += layer_cases(label, weights, max(k for _, k in dims), args, panel_call)
    return cases


def block_cases(_config: ModelConfig, args: argparse.Namespace) -> list[tuple[str, Pass, Callable[[], object]]]:
    """(label, timed pass, its output) for Q4_K (Q6_K LM head) and Q8_0 weights at every row count: the 1B
    Llama's four layers and its head, quantized as llama-quantize does (`kernels.block_quantize`)."""
    from batchserve.kernels.block_quantize import quantize_weight
    from batchserve.loadtests.bench_gguf_model import SHAPES

    shape = SHAPES["llama-1b"]
    hidden, inter = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * hidden // shape["heads"]
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    dims = layer * BLOCK_LAYERS + [(BLOCK_VOCAB, hidden)]
    cases = []
    for quantization in ("q4_k", "q8_0"):
        weights = [
            quantize_weight(torch.randn(out, k) * 0.02, quantization, head=i == len(dims) - 1)
            for i, (out, k) in enumerate(dims)
        ]
        cases += layer_cases(f"{quantization} blocks", weights, max(k for _, k in dims), args, block_call)
    return cases


def attention_cases(config: ModelConfig, args: argparse.Namespace) -> list[tuple[str, Pass, Callable[[], object]]]:
    """(label, timed pass, its output) for every row count: all layers' decode attention of one step."""
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    layers, num_pages = config.num_layers, POOL_TOKENS // PAGE_SIZE
    k_pool = torch.randn(layers, num_pages, PAGE_SIZE, kv_heads, head_dim)
    v_pool = torch.randn(layers, num_pages, PAGE_SIZE, kv_heads, head_dim)
    cases = []
    for rows in (int(r) for r in args.rows.split(",")):
        lens = torch.tensor([max(1, args.context - 7 * i % 64) for i in range(rows)], dtype=torch.int64)
        max_pages = -(-args.context // PAGE_SIZE)
        if rows * max_pages > num_pages:
            raise SystemExit(f"{rows} rows of {args.context} tokens do not fit a pool of {POOL_TOKENS} tokens")
        pages = torch.randperm(num_pages)[: rows * max_pages].view(rows, max_pages).contiguous()
        q = torch.randn(rows, heads, head_dim)
        out = torch.empty(layers, rows, heads, head_dim)

        def one_pass(lib: ctypes.CDLL, rows=rows, lens=lens, max_pages=max_pages, pages=pages, q=q, out=out) -> float:
            started = time.perf_counter()
            for layer in range(layers):
                lib.paged_decode_attention(
                    q.data_ptr(),
                    q.stride(0),
                    k_pool[layer].data_ptr(),
                    v_pool[layer].data_ptr(),
                    pages.data_ptr(),
                    max_pages,
                    lens.data_ptr(),
                    out[layer].data_ptr(),
                    rows,
                    heads,
                    kv_heads,
                    head_dim,
                    PAGE_SIZE,
                    head_dim**-0.5,
                    0,
                    0.0,
                    None,
                )  # no window, soft-cap or sinks
            return time.perf_counter() - started

        cases.append((f"{rows} requests x ~{args.context} tokens", one_pass, lambda out=out: out.clone()))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=sorted(SOURCES))
    parser.add_argument("--base", default="HEAD", help="git revision whose kernel source is the baseline")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--rows",
        default=None,
        help="tokens per call (linear, default 1,2,3,8,32) or requests (attention, default 1,16,32)",
    )
    parser.add_argument("--context", type=int, default=400, help="cached tokens per request (attention)")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    args.rows = args.rows or {"linear": "1,2,3,8,32", "blocks": "1,4,16"}.get(args.kernel, "1,16,32")
    cc = native.compiler()
    if cc is None:
        parser.error("no C compiler found (set CC)")
    files, functions = SOURCES[args.kernel]
    base_sources = {
        file: subprocess.run(
            ["git", "show", f"{args.base}:kernels/csrc/{file}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for file in files
    }
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            "base": build(cc, base_sources, Path(tmp), "base", functions),
            "tree": build(cc, {f: (native.SOURCE_DIR / f).read_text() for f in files}, Path(tmp), "tree", functions),
        }
        torch.manual_seed(0)
        config = load_model_config(ModelSpec.resolve(args.model))
        make_cases = {"linear": linear_cases, "blocks": block_cases, "attention": attention_cases}[args.kernel]
        cases = make_cases(config, args)
        shapes = "the 1B Llama's" if args.kernel == "blocks" else f"{args.model}'s"
        print(
            f"{', '.join(files)}: working tree vs {args.base}; {shapes} shapes, {torch.get_num_threads()} threads, "
            f"fastest of {args.rounds} alternating passes"
        )
        print(f"  {'case':<34} {'base ms':>9} {'tree ms':>9} {'ratio':>7}  same bits")
        for label, one_pass, output in cases:
            best, outputs = {}, {}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    best[name] = min(best.get(name, float("inf")), one_pass(lib))
                    outputs[name] = output()
            same = all(
                torch.equal(a, b)
                for a, b in zip(*(o if isinstance(o, list) else [o] for o in (outputs["base"], outputs["tree"])))
            )
            print(
                f"  {label:<34} {best['base'] * 1e3:>9.2f} {best['tree'] * 1e3:>9.2f} "
                f"{best['base'] / best['tree']:>6.2f}x  {same}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
