"""fp32 weights quantized to GGUF's k-quant blocks (Q4_K, Q5_K, Q6_K) in numpy, bit for bit in ggml's layouts
(gguf-py reads these types but cannot write them): `--quantization q4_k` at load (`kernels.block_quantize`)
and the tests' GGUF files.

The choice per sub-block is a plain min / max fit (not llama.cpp's iterative search for the scale of least
error): Q4_K's round trip on Gaussian weights is 7.8 % rms of their std.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
LEVELS = {"Q4_K": 15, "Q5_K": 31}  # largest q of the unsigned types; Q6_K's q - 32 is -32..31


def _halves(values: np.ndarray) -> np.ndarray:
    """fp32 [blocks] -> their fp16 bytes [blocks, 2]."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m [blocks, 8] -> Q4_K / Q5_K's 12 scale bytes: bytes 0-3 sc[0..3] with bits 4-5 of sc[4..7]
    on top, bytes 4-7 the same for m, bytes 8-11 the low nibbles of sc[4..7] (low) and m[4..7] (high)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    return np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )


def pack_q45(kind: str, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K blocks from d, dmin [blocks], sc, m [blocks, 8] and q [blocks, 8, 32]."""
    q = q.astype(np.uint8)
    qs = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(len(q), 128)
    parts = [_halves(d), _halves(dmin), _pack_scales(sc, m)]
    if kind == "Q5_K":  # bit j of byte i: bit 4 of sub-block j's q[i]
        parts.append(np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None], axis=1))
    return np.concatenate([*parts, qs], axis=1)


def pack_q6(d: np.ndarray, scales: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks from d [blocks], int8 scales [blocks, 16] and q (0..63) [blocks, 256]: per half of 128,
    64 bytes of low nibbles (values t and t + 64) and 32 bytes of 2-bit pairs (values t + 32 p at bits 2p)."""
    q = q.astype(np.uint8).reshape(len(q), 2, 4, 32)
    ql = (q[:, :, :2] & 0x0F) | ((q[:, :, 2:] & 0x0F) << 4)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2)
    blocks = len(q)
    return np.concatenate(
        [ql.reshape(blocks, 128), qh.reshape(blocks, 64), scales.astype(np.int8).view(np.uint8), _halves(d)], axis=1
    )


def _fp16(values: np.ndarray) -> np.ndarray:
    """values rounded to fp16, back in fp32 (finite: a scale past fp16's range is clamped)."""
    return np.minimum(values, 65504.0).astype(np.float16).astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0."""
    return np.divide(num, den, out=np.zeros(np.broadcast_shapes(num.shape, den.shape), np.float32), where=den != 0)


def _quantize_q45(x: np.ndarray, kind: str) -> np.ndarray:
    """x [blocks, 8, 32]: per sub-block q = 0..levels spans [min(x, 0), max(x)]; its scale and -min are
    6-bit multiples of the block's d and dmin (fp16), q recomputed on them."""
    levels = LEVELS[kind]
    low = np.minimum(x.min(axis=2), 0.0)
    scale, shift = (x.max(axis=2) - low) / np.float32(levels), -low  # x ~ scale * q - shift
    d, dmin = _fp16(scale.max(axis=1) / 63), _fp16(shift.max(axis=1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63)
    m = np.clip(np.rint(_ratio(shift, dmin[:, None])), 0, 63)
    ds, dm = (d[:, None] * sc)[:, :, None], (dmin[:, None] * m)[:, :, None]
    q = np.clip(np.rint(_ratio(x + dm, ds)), 0, levels)
    return pack_q45(kind, d, dmin, sc, m, q)


def _quantize_q6(x: np.ndarray) -> np.ndarray:
    """x [blocks, 16, 16]: per sub-block the value of largest size is q - 32 = -32 (as ggml picks it), the
    sub-block scales int8 multiples of the block's d (fp16), q recomputed on them."""
    picked = np.take_along_axis(x, np.abs(x).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    scale = picked / np.float32(-32)
    d = _fp16(np.abs(scale).max(axis=1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127)
    step = (d[:, None] * sc)[:, :, None]
    q = np.clip(np.rint(_ratio(x, step)), -32, 31) + 32
    return pack_q6(d, sc, q.reshape(len(x), QK_K))


def quantize_kquant_rows(w: np.ndarray, kind_name: str) -> np.ndarray:
    """fp32 [rows, cols] (cols a multiple of 256) -> uint8 blocks [rows, cols / 256 * block_bytes], whose
    de-quantization is within a few percent of w's std (Q6_K ~1.9 %, Q5_K ~3.8 %, Q4_K ~7.8 % rms on
    Gaussian weights; tests/test_quant_kquants.py holds it to 2 / 4.5 / 9 %). As in ggml, d is fp16: for
    weights of std under ~3e-4 (Q6_K; ~1e-4 Q5_K, ~3e-5 Q4_K) it nears fp16's smallest step and loses bits."""
    if kind_name not in BLOCK_BYTES or w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"{kind_name} of a {w.shape} matrix: not k-quant rows")
    rows = w.shape[0]
    x = np.ascontiguousarray(w, dtype=np.float32)
    if kind_name == "Q6_K":
        data = _quantize_q6(x.reshape(-1, 16, 16))
    else:
        data = _quantize_q45(x.reshape(-1, 8, 32), kind_name)
    return data.reshape(rows, -1)
