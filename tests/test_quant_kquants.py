"""The k-quant blocks' C kernels (`kernels/csrc/quant_kquants.c`: Q4_K, Q5_K, Q6_K): de-quantization bit for
bit as gguf-py's, the linear layer against float64 numpy doing the same integer arithmetic and against the
de-quantized weights, its independence of the batch, the plain C path against this CPU's, and the test
blocks' quantizer (`tests/kquant_blocks.py`)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from kquant_blocks import BLOCK_BYTES, quantize_kquant_rows, random_kquant_blocks
from native_marks import requires_native_kernels

from batchserve.kernels import native
from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockWeight, dequantize_blocks

pytestmark = requires_native_kernels

KINDS = ["Q4_K", "Q5_K", "Q6_K"]
ACT_MAX = 32767  # |q| of the int16 activations
FP32_UNIT = 2.0**-24  # fp32's unit roundoff
# rms of de-quantize(quantize(w)) - w over w's std, Gaussian w (measured 7.8 / 3.8 / 1.9 %)
ROUND_TRIP_ERROR = {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.02}


def gguf_dequantize(blocks: np.ndarray, kind: str) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[kind])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def random_bytes(kind: str, rows: int, cols: int, generator: np.random.Generator) -> np.ndarray:
    """Blocks of any bits, fp16 d / dmin made finite (an exponent of all ones cleared by one bit)."""
    data = generator.integers(0, 256, (rows, cols // 256 * BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks = data.reshape(-1, BLOCK_BYTES[kind])
    for high in (209,) if kind == "Q6_K" else (1, 3):  # the fp16s' high bytes
        top = blocks[:, high]
        blocks[:, high] = np.where(top & 0x7C == 0x7C, top & 0xBF, top)
    return data


def unpack(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, ...]:
    """uint8 [blocks, bytes] -> (d, dmin [blocks], scales, mins [blocks, subs], q [blocks, subs, size]): the
    weights are d * scales * q - dmin * mins, q signed for Q6_K (its q - 32)."""
    blocks = blocks.reshape(-1, BLOCK_BYTES[kind])
    count = len(blocks)

    def half(at: int) -> np.ndarray:
        return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)

    if kind == "Q6_K":
        ql, qh = blocks[:, :128].reshape(count, 2, 64), blocks[:, 128:192].reshape(count, 2, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=2)
        high = (qh[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        q = (low | (high.reshape(count, 2, 128) << 4)).astype(np.int64) - 32
        scales = blocks[:, 192:208].view(np.int8).astype(np.int64)
        return half(208), np.zeros(count, np.float32), scales, np.zeros_like(scales), q.reshape(count, 16, 16)
    s = blocks[:, 4:16].astype(np.int64)
    scales = np.concatenate([s[:, :4] & 63, (s[:, 8:] & 15) | ((s[:, :4] >> 6) << 4)], axis=1)
    mins = np.concatenate([s[:, 4:8] & 63, (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs_at = 48 if kind == "Q5_K" else 16
    qs = blocks[:, qs_at : qs_at + 128].reshape(count, 4, 1, 32)
    q = ((qs >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15).reshape(count, 8, 32).astype(np.int64)
    if kind == "Q5_K":
        q |= ((blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int64) << 4
    return half(0), half(2), scales, mins, q


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [m, k] -> (d [m, k/256] fp32, q [m, k/256, 256] int64) as quantize_act256: d = max|x| / 32767 and
    q = x * (1/d) rounded half to even, in fp32."""
    blocks = x.reshape(len(x), -1, 256)
    d = np.abs(blocks).max(axis=2) / np.float32(ACT_MAX)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return d, np.rint(blocks * inv[:, :, None]).astype(np.int64)


def integer_sums(x: np.ndarray, data: np.ndarray, kind: str) -> tuple[np.ndarray, ...]:
    """The kernel's exact integers and factors per (activation row, weight row, block): isum = sum of
    w q_x (w = scale * q, Q6_K's q less 32), msum = sum of each sub-block's min times its q_x's sum, and dx,
    d, dmin; [m, n, blocks] each."""
    n = len(data)
    d, dmin, scales, mins, q = unpack(data, kind)
    blocks, subs = d.size // n, scales.shape[1]
    dx, qx = quantize_activations(x)
    qx = qx.reshape(len(x), blocks, subs, -1)
    weights = scales.reshape(n, blocks, subs, 1) * q.reshape(n, blocks, subs, -1)
    isum = np.einsum("nbst,ibst->inb", weights, qx)
    msum = np.einsum("nbs,ibs->inb", mins.reshape(n, blocks, subs), qx.sum(axis=3))
    shape = isum.shape
    d, dmin = (np.broadcast_to(v.reshape(1, n, blocks), shape) for v in (d, dmin))
    return isum, msum, np.broadcast_to(dx[:, None, :], shape), d, dmin


def emulate_fp32(x: np.ndarray, data: np.ndarray, kind: str, bias: np.ndarray | None = None) -> np.ndarray:
    """The kernel bit for bit: per block (dx*d) * float(isum) - (dx*dmin) * float(msum) (Q6_K: the first
    product), each step rounded to fp32, added to the row's sum block after block from 0; then + bias."""
    isum, msum, dx, d, dmin = integer_sums(x, data, kind)
    high = (dx * d) * isum.astype(np.float64).astype(np.float32)
    terms = high if kind == "Q6_K" else high - (dx * dmin) * msum.astype(np.float64).astype(np.float32)
    acc = np.zeros(terms.shape[:2], np.float32)
    for b in range(terms.shape[2]):
        acc = acc + terms[:, :, b]
    return acc if bias is None else acc + bias


def float64_reference(x: np.ndarray, data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The same arithmetic in float64 (the integers exact), and its size: the sum over blocks of
    |dx d isum| + |dx dmin msum|, what the fp32 steps' rounding scales with."""
    isum, msum, dx, d, dmin = (v.astype(np.float64) for v in integer_sums(x, data, kind))
    high, low = dx * d * isum, dx * dmin * msum
    return (high - low).sum(axis=2), (np.abs(high) + np.abs(low)).sum(axis=2)


def same_bits_or_nan(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_py_bit_for_bit(kind: str) -> None:
    generator = np.random.default_rng(len(kind) + ord(kind[1]))
    for data in (random_kquant_blocks(kind, 16, 1024, generator), random_bytes(kind, 16, 1024, generator)):
        expected = gguf_dequantize(data, kind)
        assert same_bits(dequantize_blocks(torch.from_numpy(data), BLOCK_TYPES[kind]).numpy(), expected)
        d, dmin, scales, mins, q = unpack(data, kind)  # the tests' reading of the layout, checked the same way
        rebuilt = (d[:, None] * scales.astype(np.float32))[:, :, None] * q.astype(np.float32)
        rebuilt -= (dmin[:, None] * mins.astype(np.float32))[:, :, None]
        assert same_bits(rebuilt.reshape(16, -1), expected)


def test_random_blocks_look_like_model_weights() -> None:
    generator = np.random.default_rng(5)
    for kind in KINDS:
        data = random_kquant_blocks(kind, 64, 512, generator)
        assert data.shape == (64, 2 * BLOCK_BYTES[kind]) and data.dtype == np.uint8
        weights = gguf_dequantize(data, kind)
        assert np.isfinite(weights).all()
        assert 0.02 <= weights.std() <= 0.1 and abs(weights.mean()) < 0.2 * weights.std(), kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(37, 256), (19, 1024), (5, 2304)])
def test_linear_is_the_integer_arithmetic_and_near_the_dequantized_product(kind: str, n: int, k: int) -> None:
    """Bit for bit the fp32 emulation, within fp32's rounding of the float64 reference ((blocks + 4) units of
    its size), and against the de-quantized weights w: |y - x . w| <= sum_i |w_i| |x_i - dx q_i| (<= dx / 2 *
    sum |w| per block, dx = max |x| / 32767: ~258x tighter than int8's / 127), plus that fp32 rounding, plus
    w's own rounding; rms of the error measured 2.7e-5 .. 3.6e-5 of the outputs' (held to 6e-5)."""
    generator = np.random.default_rng(n + k)
    data = random_kquant_blocks(kind, n, k, generator)
    x = (generator.standard_normal((6, k)) * np.logspace(-2, 1, 6)[:, None]).astype(np.float32)
    bias = generator.standard_normal(n).astype(np.float32)
    weight = BlockWeight(torch.from_numpy(data), BLOCK_TYPES[kind])
    y = weight(torch.from_numpy(x)).numpy()
    assert same_bits(y, emulate_fp32(x, data, kind))
    assert same_bits(weight(torch.from_numpy(x), torch.from_numpy(bias)).numpy(), emulate_fp32(x, data, kind, bias))
    expected, size = float64_reference(x, data, kind)
    fp32_rounding = (k // 256 + 4) * FP32_UNIT * size
    assert (np.abs(y - expected) <= fp32_rounding).all()

    w = gguf_dequantize(data, kind).astype(np.float64)
    dx, qx = quantize_activations(x)
    rounding = np.abs(x.astype(np.float64) - (dx[:, :, None] * qx).reshape(x.shape))
    assert (rounding <= np.repeat(dx, 256, axis=1) * 0.51).all()  # fp32 x * (1/d): a hair past half a step
    exact = x.astype(np.float64) @ w.T
    bound = rounding @ np.abs(w).T + fp32_rounding + 2 * FP32_UNIT * np.abs(x) @ np.abs(w).T
    assert (np.abs(y - exact) <= bound).all()
    assert np.sqrt((((y - exact) ** 2).sum(axis=1) / (exact**2).sum(axis=1)).mean()) < 6e-5


def extreme_blocks(kind: str, blocks: int) -> np.ndarray:
    """Blocks whose w_i = scale * q (Q6_K: scale * (q - 32)) are all the largest there is, d = dmin = 1: Q4_K
    63 * 15, Q5_K 63 * 31 (and mins 63), Q6_K -128 * -32 = 4096."""
    block = np.zeros(BLOCK_BYTES[kind], np.uint8)
    if kind == "Q6_K":
        block[192:208] = 0x80  # scales -128, q 0
        block[208:210] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    else:
        block[0:4] = np.frombuffer(np.array([1, 1], np.float16).tobytes(), np.uint8)
        block[4:] = 0xFF  # sc = m = 63, q = 15 (Q5_K: fifth bits set, 31)
    return np.tile(block, (1, blocks))


@pytest.mark.parametrize("kind", KINDS)
def test_the_largest_sums_are_exact(kind: str) -> None:
    """|q_x| = 32767 against the largest weights: each int32 lane at its bound (Q5_K 2047806432, Q6_K
    2147418112 per half-block), isum past 2^33; the result is the exact integers' (no lane wrapped)."""
    k = 1024
    data = np.concatenate([extreme_blocks(kind, k // 256)] * 3)
    x = np.ones((6, k), np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] *= 3.0
    weight = BlockWeight(torch.from_numpy(data), BLOCK_TYPES[kind])
    y = weight(torch.from_numpy(x)).numpy()
    assert same_bits(y, emulate_fp32(x, data, kind))
    isum = integer_sums(x, data, kind)[0]
    per_value = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 4096}[kind]
    assert (isum[0] == 256 * per_value * ACT_MAX).all() and (isum[1] == -isum[0]).all() and (isum[2] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [768, 1280])
def test_each_row_is_what_it_is_alone_whatever_the_batch(kind: str, k: int) -> None:
    """Rows go 4 at a time through a weight row's blocks (then 1 to 3 left over), 4 (row, block) sums at a time
    (4 blocks of one row, 2 of two rows, 1 of more; here 3 and 5 blocks, with leftovers): 1 .. 13 rows, each
    the same bits as alone and as the emulation."""
    generator = np.random.default_rng(11)
    data = random_kquant_blocks(kind, 45, k, generator)
    weight = BlockWeight(torch.from_numpy(data), BLOCK_TYPES[kind])
    bias = torch.randn(45)
    wide = torch.randn(13, k + 40) * torch.logspace(-3, 2, 13)[:, None]
    wide[4] = 0.0  # activations of zeros: d = 0, the output is the bias
    x = wide[:, 24 : 24 + k]  # strided rows
    alone = torch.cat([weight(x[i : i + 1], bias) for i in range(13)])
    assert torch.equal(alone[4], bias)
    assert same_bits(alone.numpy(), emulate_fp32(x.numpy(), data, kind, bias.numpy()))
    assert torch.equal(weight(x.contiguous(), bias), alone)
    for rows in range(1, 14):
        assert torch.equal(weight(x[:rows], bias), alone[:rows])
        assert torch.equal(weight(x[13 - rows :], bias), alone[13 - rows :])


@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_round_trip(kind: str) -> None:
    generator = np.random.default_rng(3)
    w = generator.standard_normal((256, 1024)).astype(np.float32) * 0.05
    w[:64] *= np.logspace(-1, 1, 64, dtype=np.float32)[:, None]  # rows of different size
    w[64] = 0.0
    w[65] = np.abs(w[65]) + 0.1  # no negative value: the minimum is 0
    data = quantize_kquant_rows(w, kind)
    assert data.shape == (256, 4 * BLOCK_BYTES[kind]) and data.dtype == np.uint8
    back = gguf_dequantize(data, kind)
    assert (back[64] == 0).all()
    error = np.sqrt(((back - w) ** 2).mean(axis=1) / (w**2).mean(axis=1).clip(1e-30))  # of w's rms
    assert error[66:].max() < ROUND_TRIP_ERROR[kind] * 1.2 and np.median(error[66:]) < ROUND_TRIP_ERROR[kind]
    assert error[:64].max() < 2 * ROUND_TRIP_ERROR[kind] and error[65] < 2 * ROUND_TRIP_ERROR[kind]
    flat = generator.standard_normal((64, 1024)).astype(np.float32) * 0.05
    flat_back = gguf_dequantize(quantize_kquant_rows(flat, kind), kind)
    assert np.sqrt(((flat_back - flat) ** 2).mean()) / flat.std() < ROUND_TRIP_ERROR[kind]


# quant_linear.c's table names every format: the legacy ones as placeholders here (never called)
LEGACY_STUBS = """#include "quant_blocks.h"
#define STUB(name) __attribute__((weak)) const BlockFormat name = {-1, 0, 0, 0, 0};
STUB(FORMAT_Q8_0) STUB(FORMAT_Q4_0) STUB(FORMAT_Q4_1) STUB(FORMAT_Q5_0) STUB(FORMAT_Q5_1) STUB(FORMAT_MXFP4)
"""


def build_blocks(tmp_path, march: str, target: str, *extra: str) -> None:
    """quant_linear.c, the k-quants and the panel kernel (the many-rows path) alone (a whole library's build
    takes ~30 s on two cores) for `march`."""
    stubs = tmp_path / "legacy_stubs.c"
    stubs.write_text(LEGACY_STUBS)
    flags = [flag.replace("-march=native", f"-march={march}") for flag in native.BASE_FLAGS]
    sources = [native.SOURCE_DIR / f for f in ("quant_linear.c", "quant_kquants.c", "panel_linear.c")] + [stubs]
    command = [native.compiler(), *flags, f"-I{native.SOURCE_DIR}", *extra, *map(str, sources), "-o", target, "-lm"]
    subprocess.run(command, check=True)


def block_library(tmp_path, march: str) -> ctypes.CDLL:
    target = tmp_path / f"blocks-{march}.so"
    build_blocks(tmp_path, march, str(target), "-fopenmp")
    lib = ctypes.CDLL(str(target))
    for name in ("block_linear", "block_dequantize"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = native.SIGNATURES[name]
    return lib


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="builds for x86-64")
def test_the_plain_c_path_gives_this_cpus_bits(tmp_path) -> None:
    """-march=x86-64 has no AVX2: the plain C sums, the same integers and the same float steps."""
    plain = block_library(tmp_path, "x86-64")
    generator = np.random.default_rng(7)
    for kind in KINDS:
        kind_id, make = BLOCK_TYPES[kind].id, random_kquant_blocks
        for n, k in [(37, 256), (129, 1280), (31, 4096)]:
            data = torch.from_numpy((random_bytes if n == 129 else make)(kind, n, k, generator))
            weight = BlockWeight(data, BLOCK_TYPES[kind])
            values, blocks = torch.empty(n, k), data.numel() // BLOCK_BYTES[kind]
            assert plain.block_dequantize(kind_id, data.data_ptr(), blocks, values.data_ptr()) == 0
            assert torch.equal(values, weight.dequantize())
            bias = torch.randn(n)
            w, b = data.data_ptr(), bias.data_ptr()
            for m in (1, 4, 9):
                x, y = torch.randn(m, k) * 3, torch.empty(m, n)
                rc = plain.block_linear(x.data_ptr(), m, k, w, kind_id, b, n, k, y.data_ptr())
                assert rc == 0 and same_bits_or_nan(y.numpy(), weight(x, bias).numpy()), (kind, n, k, m)
        extreme = torch.from_numpy(extreme_blocks(kind, 4))
        x, y = torch.full((2, 1024), -2.0), torch.empty(2, 1)
        assert plain.block_linear(x.data_ptr(), 2, 1024, extreme.data_ptr(), kind_id, None, 1, 1024, y.data_ptr()) == 0
        assert torch.equal(y, BlockWeight(extreme, BLOCK_TYPES[kind])(x))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="builds for x86-64")
def test_the_vnni_path_compiles(tmp_path) -> None:
    """Sapphire Rapids (AVX512-VNNI) and Alder Lake (AVX-VNNI) builds use vpdpwssd; this CPU may not run them."""
    for march in ("sapphirerapids", "alderlake"):
        target = tmp_path / f"kquants-{march}.o"
        flags = [flag.replace("-march=native", f"-march={march}") for flag in native.BASE_FLAGS if flag != "-shared"]
        source = native.SOURCE_DIR / "quant_kquants.c"
        subprocess.run([native.compiler(), *flags, "-c", str(source), "-o", str(target)], check=True)
        if shutil.which("objdump"):
            listing = subprocess.run(["objdump", "-d", str(target)], capture_output=True, text=True, check=True)
            assert "vpdpwssd" in listing.stdout and "vfmadd" not in listing.stdout, march
