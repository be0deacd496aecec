"""ggml's 32-value block types in C (`kernels/csrc/quant_legacy.c`: Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 MXFP4):
de-quantization bit for bit as gguf-py's numpy, the linear layer as its stated arithmetic on int16
activations (emulated in numpy float32 bit for bit, and in float64) and within the activations' rounding of
the exact product, a row's output independent of its batch (whatever rows share its group of 4), and the
plain C build (no AVX2) and the VNNI builds giving the AVX2 build's bits."""

from __future__ import annotations

import contextlib
import ctypes
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from native_marks import requires_native_kernels

from batchserve.kernels import native, native_build
from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockWeight, dequantize_blocks

pytestmark = requires_native_kernels

LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]
WITH_MIN = ("Q4_1", "Q5_1")
MXFP4_TWICE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int64)
ACT_MAX = 32767  # quant_blocks.h: activations to int16, d = max |x| / ACT_MAX per 32 values
LANES = 8  # quant_legacy.c: block b's term goes to accumulator b % 8
# ||y - x @ dequantized.T|| / ||x @ dequantized.T|| for Gaussian x and weights quantized by gguf-py: the
# activations' rounding to 32767 steps per 32 values (measured: 2.2e-5 for every type, 258 times less than
# int8's 0.0056)
RELATIVE_BOUND = 4e-5


def gguf_type(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def finite_halves(rng: np.random.Generator, shape: tuple[int, ...], wide: bool) -> np.ndarray:
    """fp16 bit patterns: any finite value (subnormals, +-0 included) where `wide`, else |v| < 1 of assorted
    exponents (sums of a sensible size)."""
    if wide:
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return np.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits).astype(np.uint16)
    values = rng.uniform(-1, 1, size=shape) * np.exp2(rng.integers(-9, 1, size=shape))
    return values.astype(np.float16).view(np.uint16)


def random_blocks(name: str, rows: int, blocks: int, rng: np.random.Generator, wide: bool = False) -> np.ndarray:
    """uint8 [rows, blocks * block_bytes]: random values, random finite scales (MXFP4: any e8m0 where `wide`,
    else 2^-17 .. 2^9 and in every seventh block the smallest, 2^-127 .. 2^-125, subnormal once halved)."""
    kind = BLOCK_TYPES[name]
    data = rng.integers(0, 256, size=(rows, blocks, kind.block_bytes), dtype=np.uint8)
    if name == "MXFP4" and wide:
        data[..., 0] = rng.integers(0, 256, size=(rows, blocks))
    elif name == "MXFP4":
        data[..., 0] = rng.integers(110, 136, (rows, blocks))
        data[:, ::7, 0] = rng.integers(0, 3, size=data[:, ::7, 0].shape)
    else:
        halves = 2 if name in WITH_MIN else 1
        scales = finite_halves(rng, (rows, blocks, halves), wide)
        data[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return data.reshape(rows, -1)


def quantized_blocks(name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """gguf-py's quantization of Gaussian weights, blocks of three scales: uint8 [rows, row_bytes]."""
    scale = rng.choice([0.02, 1.0, 30.0], size=(rows, k // 32, 1))
    w = (rng.standard_normal((rows, k // 32, 32)) * scale).reshape(rows, k).astype(np.float32)
    return quants.quantize(w, gguf_type(name))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def c_dequantize(data: np.ndarray, name: str) -> np.ndarray:
    return dequantize_blocks(torch.from_numpy(data), BLOCK_TYPES[name]).numpy()


def gguf_dequantize(data: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4's largest scale times 6 is inf, in both
        return quants.dequantize(data, gguf_type(name))


@pytest.mark.parametrize("name", LEGACY)
def test_dequantize_is_gguf_py_bit_for_bit(name: str) -> None:
    rng = np.random.default_rng(1)
    for data in (random_blocks(name, 7, 40, rng, wide=True), quantized_blocks(name, 5, 256, rng)):
        ours, theirs = c_dequantize(data, name), gguf_dequantize(data, name)
        assert ours.shape == theirs.shape
        assert np.array_equal(bits(ours), bits(theirs)), name  # the sign of zero and infinities too


def weight_integers(data: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A block weight's integers [n, blocks, 32] (Q4_0 nibble - 8, MXFP4 twice its value, ...) and its
    float32 scales [n, blocks] d and (Q4_1, Q5_1) m: w = d * integer (+ m)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, BLOCK_TYPES[name].block_bytes)
    if name == "MXFP4":
        e = blocks[..., 0].astype(np.uint32)
        scale = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(np.float32)
        return MXFP4_TWICE[nibbles(blocks[..., 1:])], scale, None
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if name in WITH_MIN else None
    rest = blocks[..., 4:] if m is not None else blocks[..., 2:]
    if name == "Q8_0":
        return rest.view(np.int8).astype(np.int64), d, None
    if name in ("Q4_0", "Q4_1"):
        return nibbles(rest) - (8 if name == "Q4_0" else 0), d, m
    qh = rest[..., :4].copy().view(np.uint32)  # bit i: the fifth bit of value i
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1
    return nibbles(rest[..., 4:]) + 16 * high.astype(np.int64) - (16 if name == "Q5_0" else 0), d, m


def nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """As quant_linear.c: per 32 values d = max |x| / 32767, q = round-half-even(x * (1 / d)) (float32
    steps): (q [m, blocks, 32], d [m, blocks], qsum [m, blocks])."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(axis=-1) / np.float32(ACT_MAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)  # the float32 product, rounded half to even
    assert np.abs(q).max(initial=0) <= ACT_MAX
    return q, d, q.sum(axis=-1)


def integer_sums(data: np.ndarray, name: str, x: np.ndarray) -> np.ndarray:
    """Every output's exact block sums isum [m, n, blocks] (int64)."""
    q = quantize_activations(x)[0]
    isum = np.einsum("abi,nbi->anb", q, weight_integers(data, name)[0])
    assert np.abs(isum).max(initial=0) <= 32 * 128 * ACT_MAX < 2**31  # int32 holds it
    return isum


def block_terms(data: np.ndarray, name: str, x: np.ndarray, dtype: type) -> np.ndarray:
    """Every output's block terms [m, n, blocks] in `dtype`: (d_w * d_x) * isum (+ (m_w * d_x) * qsum),
    isum converted to `dtype` once (float32: rounded to nearest even past 2^24, as C converts int32)."""
    _, d_w, m_w = weight_integers(data, name)
    _, d_x, qsum = quantize_activations(x)
    isum = integer_sums(data, name, x)
    terms = (d_w[None].astype(dtype) * d_x[:, None].astype(dtype)) * isum.astype(dtype)
    if m_w is not None:
        terms = terms + (m_w[None].astype(dtype) * d_x[:, None].astype(dtype)) * qsum[:, None].astype(dtype)
    return terms


def emulated_linear(data: np.ndarray, name: str, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The kernel's float32 arithmetic, each step rounded as C rounds it: block b's term added to
    accumulator b % 8 in block order, then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), then the bias."""
    terms = block_terms(data, name, x, np.float32)
    acc = np.zeros((*terms.shape[:2], LANES), dtype=np.float32)
    for b in range(terms.shape[2]):
        acc[..., b % LANES] = acc[..., b % LANES] + terms[..., b]
    s = acc[..., :4] + acc[..., 4:]  # s_i = a_i + a_(i+4)
    t = s[..., :2] + s[..., 2:]  # t_0 = s_0 + s_2, t_1 = s_1 + s_3
    return (t[..., 0] + t[..., 1]) + bias


def c_linear(data: np.ndarray, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return BlockWeight(torch.from_numpy(data), BLOCK_TYPES[name])(x, bias)


@pytest.mark.parametrize("name", LEGACY)
def test_linear_is_its_stated_arithmetic(name: str) -> None:
    """Bit for bit the float32 formula of quant_legacy.c's header on exact integer block sums, and within
    1e-5 of the same formula in float64 (relative to the sum of the terms' magnitudes). Rows of equal values
    (every q at 32767) make Q8_0's sums pass 2^24, where converting them to float32 rounds."""
    rng = np.random.default_rng(2)
    for k, data in ((2048, quantized_blocks(name, 67, 2048, rng)), (800, random_blocks(name, 45, 25, rng))):
        x = rng.standard_normal((7, k)).astype(np.float32)
        x[1, :32] = 0  # an all-zero activation block: d = 0
        x[2], x[3] = 1, np.where(np.arange(k) % 3 == 0, -1, 1)
        bias = rng.standard_normal(data.shape[0]).astype(np.float32)
        y = c_linear(data, name, torch.from_numpy(x), torch.from_numpy(bias)).numpy()
        assert np.array_equal(bits(y), bits(emulated_linear(data, name, x, bias))), (name, k)
        terms = block_terms(data, name, x, np.float64)
        exact = terms.sum(axis=-1) + bias
        assert np.all(np.abs(y - exact) <= 1e-5 * (np.abs(terms).sum(axis=-1) + np.abs(bias))), (name, k)
    if name == "Q8_0":  # the last data: random bytes
        assert (np.abs(integer_sums(data, name, x)) >= 2**24).any()


@pytest.mark.parametrize("name", LEGACY)
def test_linear_is_the_dequantized_product_up_to_the_activations_rounding(name: str) -> None:
    """Each output within sum over blocks of d_x / 2 * sum |w| of x @ w.T (w de-quantized, in float64): the
    activations are rounded to d_x steps, |x - d_x q| <= d_x / 2 + 2^-23 |x| (the float32 x * (1 / d_x)),
    plus 1e-6 sum |x w| for that and the float32 terms and sums (measured: the worst output at 13% of the
    bound); and the whole output within RELATIVE_BOUND."""
    rng = np.random.default_rng(3)
    k = 1024
    data = quantized_blocks(name, 96, k, rng)
    w = gguf_dequantize(data, name).astype(np.float64)
    x = rng.standard_normal((6, k)).astype(np.float32)
    y = c_linear(data, name, torch.from_numpy(x)).numpy().astype(np.float64)
    reference = x.astype(np.float64) @ w.T
    d_x = quantize_activations(x)[1]
    w_abs = np.abs(w).reshape(w.shape[0], -1, 32).sum(axis=-1)  # [n, blocks]
    bound = (d_x / 2) @ w_abs.T + 1e-6 * np.abs(x) @ np.abs(w).T
    assert np.all(np.abs(y - reference) <= bound), name
    relative = np.linalg.norm(y - reference) / np.linalg.norm(reference)
    assert relative < RELATIVE_BOUND, (name, relative)


@pytest.mark.parametrize("name", LEGACY)
def test_a_row_gives_the_same_bits_in_any_batch(name: str) -> None:
    """Below TILE_MIN_ROWS (the int16 dots; more rows go through fp32 tiles): strided rows with a bias, 10
    blocks a row (a group of 8 reduced together and 2 alone), in batches of 1 to 13 rows (groups of 4 and
    what is left), in order and reversed (each row at other places in its group, beside other rows)."""
    rng = np.random.default_rng(4)
    k, n = 320, 37
    data = random_blocks(name, n, k // 32, rng)
    wide = torch.from_numpy(rng.standard_normal((13, k + 7)).astype(np.float32))
    x, bias = wide[:, 3 : 3 + k], torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    alone = torch.cat([c_linear(data, name, x[i : i + 1], bias) for i in range(13)])
    for m in range(1, 14):
        assert torch.equal(c_linear(data, name, x[:m], bias), alone[:m]), (name, m)
        assert torch.equal(c_linear(data, name, x[:m].flip(0), bias), alone[:m].flip(0)), (name, m)


IS_X86 = platform.machine() in ("x86_64", "AMD64")
# the quant kernels and the panel kernel their many-rows path calls: a quick build
QUANT_SOURCES = sorted([*native_build.SOURCE_DIR.glob("quant_*.c"), native_build.SOURCE_DIR / "panel_linear.c"])


def build_quant_library(target: Path, march: list[str]) -> ctypes.CDLL:
    """The quant kernels built with `march` in place of -march=native (native._build, its sources narrowed)."""
    flags = [flag for flag in native.BASE_FLAGS if flag != "-march=native"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_build, "SOURCES", QUANT_SOURCES)
        native._build(native.compiler(), [*flags, *march, "-fopenmp"], target)
    lib = ctypes.CDLL(str(target))
    for name in ("block_linear", "block_dequantize"):
        function = getattr(lib, name)
        function.restype, function.argtypes = native_build.SIGNATURES[name]
    return lib


@pytest.fixture(scope="module")
def plain_library(tmp_path_factory) -> ctypes.CDLL:
    """x86-64's baseline (SSE2): the plain C path (elsewhere the compiler's default target, the same path)."""
    return build_quant_library(tmp_path_factory.mktemp("plain") / "plain.so", ["-march=x86-64"] if IS_X86 else [])


def library_linear(lib: ctypes.CDLL, data: np.ndarray, name: str, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], data.shape[0])
    blocks = torch.from_numpy(data)
    rc = lib.block_linear(
        x.data_ptr(), x.shape[0], x.stride(0), blocks.data_ptr(), BLOCK_TYPES[name].id, bias.data_ptr(),
        data.shape[0], x.shape[1], y.data_ptr(),
    )  # fmt: skip
    assert rc == 0
    return y


def library_dequantize(lib: ctypes.CDLL, data: np.ndarray, name: str) -> torch.Tensor:
    kind = BLOCK_TYPES[name]
    out = torch.empty(data.shape[0], data.shape[1] // kind.block_bytes * kind.block)
    blocks = data.size // kind.block_bytes
    assert lib.block_dequantize(kind.id, torch.from_numpy(data).data_ptr(), blocks, out.data_ptr()) == 0
    return out


def assert_same_bits_as_native(lib: ctypes.CDLL, name: str, rng: np.random.Generator) -> None:
    for k, n, m in ((32, 7, 1), (96, 101, 5), (256, 33, 13), (288, 61, 3), (4096, 19, 2)):
        data = random_blocks(name, n, k // 32, rng)
        x = torch.from_numpy(rng.standard_normal((m, k + 5)).astype(np.float32))[:, 2 : 2 + k]
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        assert torch.equal(library_linear(lib, data, name, x, bias), c_linear(data, name, x, bias)), (name, k, n, m)
    data = random_blocks(name, 9, 11, rng, wide=True)
    assert torch.equal(library_dequantize(lib, data, name), torch.from_numpy(c_dequantize(data, name))), name


@pytest.mark.parametrize("name", LEGACY)
def test_the_plain_c_build_gives_the_native_bits(name: str, plain_library: ctypes.CDLL) -> None:
    assert_same_bits_as_native(plain_library, name, np.random.default_rng(5))


def cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not IS_X86, reason="x86's VNNI path")
def test_the_vnni_path_compiles_and_gives_the_same_bits(tmp_path, plain_library: ctypes.CDLL) -> None:
    """The VNNI int16 dot products (vpdpwssd) compile: AVX512-VNNI's (sapphirerapids) and AVX-VNNI's VEX
    form (x86-64-v3 + avxvnni); where this CPU has them, they give the plain build's bits."""
    source = native_build.SOURCE_DIR / "quant_legacy.c"
    for march in (["-march=sapphirerapids"], ["-march=x86-64-v3", "-mavxvnni"]):
        asm = subprocess.run(
            [native.compiler(), "-O2", "-std=gnu11", *march, "-S", "-o", "-", str(source)],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert "vpdpwssd" in asm, march
    runnable = [
        march
        for march, needs in ((["-march=x86-64-v4", "-mavx512vnni"], {"avx512_vnni", "avx512vl"}),
                             (["-march=x86-64-v3", "-mavxvnni"], {"avx_vnni"}))
        if needs <= cpu_flags()
    ]  # fmt: skip
    if not runnable:
        pytest.skip("this CPU has no VNNI: compiled only")
    for i, march in enumerate(runnable):
        vnni = build_quant_library(tmp_path / f"vnni{i}.so", march)
        for name in LEGACY:
            rng = np.random.default_rng(6)
            data = random_blocks(name, 29, 64, rng)
            x = torch.from_numpy(rng.standard_normal((3, 2048)).astype(np.float32))
            bias = torch.zeros(29)
            expected = library_linear(plain_library, data, name, x, bias)
            assert torch.equal(library_linear(vnni, data, name, x, bias), expected), (march, name)
