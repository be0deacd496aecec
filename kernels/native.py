"""CPU kernels in C (`kernels/csrc/`), compiled on first use with the machine's C compiler and called
through ctypes on the tensors' memory.

Why C and not torch ops: a CPU decode step is many small ops, and some of them (paged attention)
have no torch form that avoids copying. A few hundred lines of plain C with OpenMP do better. Why
not a torch C++ extension: compiling against torch's headers is slow on every fresh machine; plain C
builds at once and needs no Python headers.

The library is built with `-march=native` for the machine it runs on and cached under
`BATCHSERVE_CACHE/kernels/`, named by a hash of the sources, flags, compiler and CPU. Where no
compiler works, or `BATCHSERVE_NATIVE_KERNELS=0`, `library()` returns None and callers keep their
torch path. OpenMP: torch is imported first, so the library's `libgomp.so.1` resolves to the runtime
torch already loaded and both share one thread pool and `torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from batchserve.shared.config import cache_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = sorted(SOURCE_DIR.glob("*.c"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
BASE_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC"]  # gnu11: a*b+c may fuse to FMA
DISABLE_ENV = "BATCHSERVE_NATIVE_KERNELS"

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# exported function -> (restype, argtypes)
SIGNATURES = {
    "paged_decode_attention": (
        ctypes.c_int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _f32, _ptr],
    ),
    "paged_prefill_attention": (
        ctypes.c_int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _f32, _ptr],
    ),
    "argmax_rows": (None, [_ptr, _i64, _i64, _i64, _ptr]),
    "rms_norm": (None, [_ptr, _i64, _i64, _ptr, _i64, _f32, _ptr]),
    "add_rms_norm": (None, [_ptr, _ptr, _i64, _i64, _ptr, _f32, _ptr]),
    "silu_and_mul": (None, [_ptr, _i64, _i64, _i64, _ptr]),
    "rotary": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]),
    "write_kv": (None, [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64]),
    "apply_token_bitmask": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr]),
    "f32_linear": (None, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr]),
    "int8_linear": (None, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr]),
    "decode_layers": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, *[_ptr] * 14]),
    "rms_norm_groups": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _f32, _ptr, _i64]),
    "moe_block": (ctypes.c_int, [_ptr, _ptr, _i64, _i64, _ptr]),
    "gated_delta_decode": (None, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr]),
    "causal_conv1d_decode": (None, [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr]),
}


class NativeKernelError(RuntimeError):
    pass


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, gcc or clang (None: none found)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What `-march=native` depends on: the architecture and, on Linux, the CPU's feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def has_wide_vectors() -> bool:
    """Whether `-march=native` builds the kernels' AVX-512 paths here (16-float vectors; x86-64 only)."""
    return platform.machine() in ("x86_64", "AMD64") and " avx512f" in _cpu_signature()


def _build(compiler: str, flags: list[str], target: Path) -> None:
    """Compile into a temporary file and rename it into place, so concurrent builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise NativeKernelError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users (a service account) from loading it
        with open(tmp, "rb") as built:
            os.fsync(built.fileno())  # renamed only once on disk: never an empty library after a crash
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _build_and_load(compiler: str, flags: list[str], path: Path) -> ctypes.CDLL:
    if path.exists():
        try:
            return _load(path)
        except (OSError, AttributeError):  # a library that does not load (left by an old crash): rebuild it
            path.unlink(missing_ok=True)
    _build(compiler, flags, path)
    return _load(path)


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are disabled or cannot be built (logged once)."""
    if disabled():
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): CPU ops run in torch, slower")
        return None
    errors = []
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C compiler %s does not run (%s): CPU ops run in torch, slower", cc, exc)
        return None
    # OpenMP where the compiler has it (gcc does; Apple's clang does not): otherwise one thread.
    for flags in ([*BASE_FLAGS, "-fopenmp"], BASE_FLAGS):
        key = hashlib.sha256(
            "\0".join(
                [*(s.read_text() for s in SOURCES + HEADERS), *flags, version, _cpu_signature(), torch.__version__]
            ).encode()
        ).hexdigest()[:16]
        path = cache_dir() / "kernels" / f"batchserve_kernels-{key}.so"
        try:
            lib = _build_and_load(cc, flags, path)
        except (NativeKernelError, OSError, AttributeError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
            continue
        if errors:
            log.warning("C kernels built without OpenMP (one thread), after:\n%s", "\n".join(errors))
        return lib
    log.warning("could not build the C kernels; CPU ops run in torch, slower:\n%s", "\n".join(errors))
    return None


def available() -> bool:
    return library() is not None


def applies_to(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels can take these tensors: fp32 on the CPU, and the kernels built."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return available()


def rows_contiguous(x: torch.Tensor) -> bool:
    """Whether x is contiguous within each index of its first dimension (the rows may be strided).
    Plain stride arithmetic: the kernels are called ~6 times per layer, so their checks must be cheap."""
    shape, strides = x.shape, x.stride()
    expected = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise NativeKernelError("the C kernels are not available on this machine")
    return lib


def _check_rows(x: torch.Tensor, name: str) -> None:
    """x is fp32 on the CPU, and contiguous within each row of its first dimension."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"{name} must be float32 on the CPU")
    if x.dim() < 1 or not rows_contiguous(x):
        raise ValueError(f"{name} must be contiguous within each row")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [rows, n] (rows may be strided), with torch's ties and NaN answer."""
    _check(x.dim() == 2 and x.shape[1] > 0, "x must be [rows, n] with n > 0")
    _check_rows(x, "x")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().argmax_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], out.data_ptr())
    return out


def apply_token_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf in scores [rows, vocab] (rows may be strided) where bitmask [rows, words] int32 has a 0 bit;
    returns a bool [rows]: the rows with no finite allowed score left."""
    rows, vocab = scores.shape
    _check(
        bitmask.dtype is torch.int32
        and bitmask.is_cpu
        and bitmask.is_contiguous()
        and bitmask.shape[0] == rows
        and bitmask.shape[1] * 32 >= vocab,
        "bitmask [rows, >= vocab / 32] int32",
    )
    _check_rows(scores, "scores")
    dead = torch.empty(rows, dtype=torch.bool)
    _lib().apply_token_bitmask(
        scores.data_ptr(), rows, scores.stride(0), vocab, bitmask.data_ptr(), bitmask.shape[1], dead.data_ptr()
    )
    return dead


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [rows, dim] (rows may be strided) -> a new contiguous [rows, dim]."""
    _check(x.dim() == 2 and weight.shape == x.shape[1:] and weight.is_contiguous(), "x [rows, dim], weight [dim]")
    _check_rows(x, "x")
    _check_rows(weight, "weight")
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().rms_norm(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), x.shape[1], eps, out.data_ptr())
    return out


def rms_norm_groups(x: torch.Tensor, groups: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each of the `groups` equal runs of each row of x [rows, groups * dim] (rows may be
    strided), all by weight [dim] -> a new contiguous [rows, groups * dim]."""
    _check(
        x.dim() == 2 and groups >= 1 and x.shape[1] % groups == 0 and weight.shape == (x.shape[1] // groups,),
        "x [rows, groups * dim], weight [dim]",
    )
    _check_rows(x, "x")
    _check_rows(weight, "weight")
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().rms_norm_groups(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        groups,
        weight.shape[0],
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        x.shape[1],
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x += residual in place (both contiguous [rows, dim]), then (RMSNorm(x) as a new tensor, x)."""
    _check(
        x.dim() == 2 and residual.shape == x.shape and weight.shape == x.shape[1:],
        "x and residual [rows, dim], weight [dim]",
    )
    _check(x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous(), "x, residual, weight contiguous")
    size = x.numel() * x.element_size()
    _check(
        x.data_ptr() + size <= residual.data_ptr() or residual.data_ptr() + size <= x.data_ptr() or size == 0,
        "x and residual must not overlap",
    )
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        _check_rows(t, name)
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().add_rms_norm(
        x.data_ptr(), residual.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr()
    )
    return out, x


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [rows, heads, head_dim] by cos/sin [rows, head_dim]."""
    rows, heads, head_dim = x.shape
    _check(
        cos.shape == sin.shape == (rows, head_dim)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and head_dim % 2 == 0,
        "cos and sin must be contiguous [rows, head_dim], head_dim even",
    )
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        _check_rows(t, name)
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().rotary(x.data_ptr(), rows, x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [rows, 2 * half] (rows may be strided) -> [rows, half]."""
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up must be [rows, 2 * half]")
    _check_rows(gate_up, "gate_up")
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, half), dtype=torch.float32)
    _lib().silu_and_mul(gate_up.data_ptr(), rows, gate_up.stride(0), half, out.data_ptr())
    return out


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One input of each row (x [rows, >= channels], its first `channels`) through the causal convolution
    weight [channels, K] and SiLU, after the rows' windows pool[slots] [channels, K - 1], which move on in
    place -> out [rows, channels]."""
    rows, (channels, taps) = x.shape[0], weight.shape
    _check(
        x.dim() == 2
        and x.shape[1] >= channels
        and weight.is_contiguous()
        and pool.is_contiguous()
        and pool.shape[1:] == (channels, taps - 1),
        "x [rows, >= C], weight [C, K], pool [slots, C, K - 1]",
    )
    _check_slots(slots, rows, pool.shape[0])
    for name, t in (("x", x), ("weight", weight), ("pool", pool)):
        _check_rows(t, name)
    out = torch.empty((rows, channels), dtype=torch.float32)
    _lib().causal_conv1d_decode(
        x.data_ptr(),
        rows,
        x.stride(0),
        weight.data_ptr(),
        channels,
        taps - 1,
        pool.data_ptr(),
        slots.data_ptr(),
        out.data_ptr(),
    )
    return out


def _check_slots(slots: torch.Tensor, rows: int, pool_slots: int) -> None:
    _check(
        slots.dtype is torch.int64
        and slots.is_contiguous()
        and slots.shape == (rows,)
        and (rows == 0 or 0 <= int(slots.min()) and int(slots.max()) < pool_slots),
        "slots: int64 rows of pool",
    )


def gated_delta_decode(
    mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, key_heads: int
) -> torch.Tensor:
    """One token of each row (mixed [rows, q | k | v], g and beta [rows, value_heads]) through the gated delta
    rule, updating the rows' states pool[slots] [value_heads, dk, dv] in place -> out [rows, value_heads, dv]."""
    rows = mixed.shape[0]
    _, value_heads, dk, dv = pool.shape
    _check(
        mixed.dim() == 2 and mixed.shape[1] == 2 * key_heads * dk + value_heads * dv and value_heads % key_heads == 0,
        "mixed must be [rows, 2 * key_heads * dk + value_heads * dv]",
    )
    _check(
        g.shape == beta.shape == (rows, value_heads) and g.is_contiguous() and beta.is_contiguous(),
        "g and beta must be contiguous [rows, value_heads]",
    )
    _check(pool.is_contiguous(), "pool must be contiguous")
    _check_slots(slots, rows, pool.shape[0])
    for name, t in (("mixed", mixed), ("g", g), ("beta", beta), ("pool", pool)):
        _check_rows(t, name)
    out = torch.empty((rows, value_heads, dv), dtype=torch.float32)
    _lib().gated_delta_decode(
        mixed.data_ptr(),
        rows,
        mixed.stride(0),
        g.data_ptr(),
        beta.data_ptr(),
        pool.data_ptr(),
        slots.data_ptr(),
        key_heads,
        value_heads,
        dk,
        dv,
        out.data_ptr(),
    )
    return out


PANEL = 16  # output columns per packed weight panel (PANEL in csrc/panel_linear.c)


def check_panels(packed: torch.Tensor, scale: torch.Tensor | None, out_features: int) -> None:
    """The layout `panel_linear` trusts: packed [panels, in, PANEL] fp32, or int8 with scale [panels * PANEL]
    fp32, covering out_features columns."""
    _check(
        packed.dim() == 3
        and packed.shape[2] == PANEL
        and packed.is_contiguous()
        and packed.is_cpu
        and packed.dtype in (torch.float32, torch.int8),
        "packed must be [panels, in, 16] fp32 or int8",
    )
    _check(packed.shape[0] * PANEL >= out_features > (packed.shape[0] - 1) * PANEL, "out_features")
    _check(
        packed.dtype != torch.int8
        or (
            scale is not None
            and scale.shape == (packed.shape[0] * PANEL,)
            and scale.dtype == torch.float32
            and scale.is_contiguous()
        ),
        "int8 panels need scale [panels * 16] fp32",
    )


def panel_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    *,
    panels_checked: bool = False,
) -> torch.Tensor:
    """x [m, in] (rows may be strided) times a weight packed by `kernels.panel_linear.pack_panels`
    (packed [panels, in, PANEL] fp32, or int8 with scale [panels * PANEL]), plus bias [out]: [m, out] fp32.
    `panels_checked`: the caller ran `check_panels` on this weight already (the per-call checks of an
    unchanging weight cost about as much as the kernel itself on a decode row)."""
    if not panels_checked:
        check_panels(packed, scale, out_features)
    _check(x.dim() == 2 and x.shape[1] == packed.shape[1], "x must be [m, in]")
    _check_rows(x, "x")
    if bias is not None:
        _check(
            bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_contiguous(),
            "bias must be [out] fp32",
        )
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    bias_ptr = bias.data_ptr() if bias is not None else None
    if packed.dtype == torch.int8:
        _lib().int8_linear(
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            packed.data_ptr(),
            scale.data_ptr(),
            bias_ptr,
            out_features,
            x.shape[1],
            out.data_ptr(),
        )
    else:
        _lib().f32_linear(
            x.data_ptr(), x.shape[0], x.stride(0), packed.data_ptr(), bias_ptr, out_features, x.shape[1], out.data_ptr()
        )
    return out


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    locs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    locs_checked: bool = False,
) -> None:
    """k_pool.flatten(0, 1)[locs] = k (and v alike): pools [pages, page_size, kv_heads, head_dim], k/v
    [tokens, kv_heads, head_dim] (rows may be strided), locs [tokens] int64 flat token slots.
    `locs_checked`: the caller ran `check_locs` on these locs already."""
    _check(k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape == v_pool.shape, "pools must match")
    _check(k.shape == v.shape == (locs.shape[0], *k_pool.shape[2:]), "k/v must be [tokens, kv_heads, head_dim]")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k", k), ("v", v)):
        _check_rows(t, name)
    if not locs_checked:
        check_locs(locs, k_pool.shape[0] * k_pool.shape[1])
    _lib().write_kv(
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        k_pool.shape[2] * k_pool.shape[3],
        locs.data_ptr(),
        locs.shape[0],
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
    )


def check_locs(locs: torch.Tensor, num_slots: int) -> None:
    """The bound `write_kv` trusts: every loc is a token slot of the pool."""
    _check(
        locs.dtype == torch.int64 and locs.dim() == 1 and locs.is_contiguous() and locs.is_cpu,
        "locs must be a contiguous int64 CPU vector",
    )
    if locs.numel():
        _check(int(locs.min()) >= 0 and int(locs.max()) < num_slots, "a KV location is outside the pool")


MAX_CONTEXT = 2**31 - 1  # max_pages * page_size: the C code sizes scratch buffers with it


def _check_page_layout(pages: torch.Tensor, lens: torch.Tensor, page_size: int) -> None:
    _check(
        pages.dtype == lens.dtype == torch.int64
        and pages.is_contiguous()
        and lens.is_contiguous()
        and pages.dim() == 2
        and lens.shape == pages.shape[:1]
        and pages.is_cpu
        and lens.is_cpu,
        "pages [b, max_pages] and lens [b] must be contiguous int64 CPU tensors",
    )
    _check(page_size >= 1 and pages.shape[1] * page_size <= MAX_CONTEXT, "max_pages * page_size out of range")


def check_pages(pages: torch.Tensor, lens: torch.Tensor, num_pages: int, page_size: int) -> None:
    """The bounds the C code trusts: every page inside the pool, 1 <= lens <= max_pages * page_size."""
    _check_page_layout(pages, lens, page_size)
    if lens.numel():
        _check(
            int(lens.min()) >= 1 and int(lens.max()) <= pages.shape[1] * page_size,
            "lens out of [1, max_pages * page_size]",
        )
        _check(int(pages.min()) >= 0 and int(pages.max()) < num_pages, "a page index is outside the pool")


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    pages_checked: bool = False,
) -> torch.Tensor:
    """Attention of one query token per row over its cached tokens, read through its page list.

    q [b, heads, head_dim] (rows may be strided, heads and dims contiguous), k_pool/v_pool
    [num_pages, page_size, kv_heads, head_dim], pages [b, max_pages] int64, lens [b] int64 with
    1 <= lens <= max_pages * page_size; all fp32 on the CPU. Returns [b, heads, head_dim]. `window` > 0:
    each row attends to its last `window` tokens only (a sliding-window layer); `softcap` > 0: scores are
    soft-capped before the softmax; `sinks` [heads] fp32: each head's sink logit joins its softmax's
    denominator (gpt-oss).
    `pages_checked`: the caller ran `check_pages` on these pages and lens already (once per step
    rather than once per layer), so only their scan for out-of-range values is skipped.
    """
    lib = _lib()
    batch, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pool.shape
    _check_attention(q, k_pool, v_pool, window, sinks)
    if pages_checked:
        _check_page_layout(pages, lens, page_size)
    else:
        check_pages(pages, lens, num_pages, page_size)
    if lens.shape[0] != batch:
        raise ValueError(f"{batch} query rows but {lens.shape[0]} lens")
    if batch == 0:
        return q.new_empty(q.shape)
    max_pages = pages.shape[1]
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32)
    status = lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        pages.data_ptr(),
        max_pages,
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory")
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pages: torch.Tensor,
    prefix: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk of one sequence: q [length, heads, head_dim] (rows may be strided) at positions prefix .. prefix +
    length - 1 attends causally to the sequence's tokens through its pages [max_pages] int64 (the chunk's own
    keys and values written to the pool already; every page checked by the caller); window, softcap and sinks
    as in `paged_decode_attention`. Into `out` (a fresh tensor when None): [length, heads, head_dim], rows may be
    strided."""
    length, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    _check_attention(q, k_pool, v_pool, window, sinks)
    _check(
        pages.dim() == 1 and pages.is_contiguous() and pages.dtype == torch.int64 and pages.is_cpu,
        "pages must be [max_pages] int64 on the CPU",
    )
    _check(0 <= prefix and prefix + length <= pages.shape[0] * page_size, "the chunk runs past its pages")
    if out is None:
        out = torch.empty((length, heads, head_dim), dtype=torch.float32)
    _check(out.shape == q.shape and out.stride(2) == 1 and out.stride(1) == head_dim, "out must be shaped as q")
    status = _lib().paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        pages.data_ptr(),
        prefix,
        length,
        out.data_ptr(),
        out.stride(0),
        heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_prefill_attention could not allocate its scratch memory")
    return out


def _check_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, window: int, sinks: torch.Tensor | None
) -> None:
    """What both attention kernels need of q, the pools and the sinks (each checks its pages its own way)."""
    _, heads, head_dim = q.shape
    _, _, kv_heads, pool_head_dim = k_pool.shape
    _check(q.dtype is k_pool.dtype is v_pool.dtype is torch.float32, "q, k_pool and v_pool must be float32")
    _check(q.is_cpu and k_pool.is_cpu and v_pool.is_cpu, "tensors must be on the CPU")
    if (
        min(heads, kv_heads, head_dim) < 1
        or pool_head_dim != head_dim
        or heads % kv_heads
        or v_pool.shape != k_pool.shape
    ):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
        )
    _check(q.stride(2) == 1 and q.stride(1) == head_dim, "q's heads and dims must be contiguous")
    _check(k_pool.is_contiguous() and v_pool.is_contiguous(), "the pools must be contiguous")
    _check(window >= 0, "window must be >= 0")
    _check(
        sinks is None
        or (sinks.shape == (heads,) and sinks.dtype == torch.float32 and sinks.is_cpu and sinks.is_contiguous()),
        f"sinks must be contiguous fp32 [{heads}] on the CPU",
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
