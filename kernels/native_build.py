"""Building and loading the C kernels' library (`kernels/csrc/`): the machine's C compiler, the build
cached by a hash of what the library depends on, and the ctypes signatures of what it exports.

The library is built with `-march=native` for the machine it runs on and cached under
`BATCHSERVE_CACHE/kernels/`, named by a hash of the sources, flags, compiler and CPU. Where no
compiler works, or `BATCHSERVE_NATIVE_KERNELS=0`, `library()` returns None and callers keep their
torch path. OpenMP: torch is imported first, so the library's `libgomp.so.1` resolves to the runtime
torch already loaded and both share one thread pool and `torch.set_num_threads`.

The kernels' Python forms are `kernels.native`, which re-exports what its callers use of this module.
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

log = logging.getLogger("batchserve.kernels.native")  # the name its warnings have always had

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
    "block_dequantize": (ctypes.c_int, [_i64, _ptr, _i64, _ptr]),
    "block_linear": (ctypes.c_int, [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr]),
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


def loaded_library() -> ctypes.CDLL:
    """`library()`, or NativeKernelError where there is none: what each kernel's Python form calls."""
    lib = library()
    if lib is None:
        raise NativeKernelError("the C kernels are not available on this machine")
    return lib


def available() -> bool:
    return library() is not None
