"""Random GGUF k-quant blocks (Q4_K, Q5_K, Q6_K) for tests, bit for bit in ggml's layouts, and the quantizer
the tests write their k-quant files with (`kernels.kquant_quantize`, re-exported).

`random_kquant_blocks` gives valid blocks of random bits whose weights have a model-like size.
"""

from __future__ import annotations

import numpy as np

from batchserve.kernels.kquant_quantize import BLOCK_BYTES, LEVELS, QK_K, pack_q6, pack_q45, quantize_kquant_rows

__all__ = ["BLOCK_BYTES", "quantize_kquant_rows", "random_kquant_blocks"]

# the weights' size per block is d times this (random bits): about 0.02 .. 0.1 over d's random range
_RANDOM_D = {"Q4_K": 2.0e-4, "Q5_K": 1.0e-4, "Q6_K": 3.6e-5}


def random_kquant_blocks(kind_name: str, rows: int, cols: int, generator: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / 256 * block_bytes]: random quant bits and scales, d (and dmin) drawn so the
    weights have std about 0.02 .. 0.1 and roughly zero mean, as a model's do."""
    if kind_name not in BLOCK_BYTES or cols % QK_K:
        raise ValueError(f"{kind_name} rows of {cols} values: not k-quant blocks")
    blocks = rows * cols // QK_K
    d = generator.uniform(0.5, 2.0, blocks).astype(np.float32) * np.float32(_RANDOM_D[kind_name])
    if kind_name == "Q6_K":
        scales = generator.integers(-128, 128, (blocks, 16))
        data = pack_q6(d, scales, generator.integers(0, 64, (blocks, QK_K)))
    else:
        levels = LEVELS[kind_name]
        sc, m = generator.integers(0, 64, (blocks, 8)), generator.integers(0, 64, (blocks, 8))
        dmin = d * np.float32(levels / 2)  # mean sc * q ~ mean dmin/d * m: centred weights
        data = pack_q45(kind_name, d, dmin, sc, m, generator.integers(0, levels + 1, (blocks, 8, 32)))
    return data.reshape(rows, -1)
