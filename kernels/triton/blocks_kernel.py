"""The Triton kernel behind `kernels.triton.blocks` (imported only where triton is installed): x times a weight
kept in GGUF blocks of 32 (Q4_0, Q4_1, Q8_0: what GGUF legacy files and AWQ / GPTQ / FP8 folders are kept
in, `procs.worker.hf_quantized`), the blocks de-quantized in registers tile by tile: W4A16 / W8A16.

Program (row block, output block): for each BLOCK_K-column run of the inputs it reads every output row's
blocks there (`BLOCK_BYTES` apart; each its fp16 scale d, Q4_1's fp16 min m, then the values), makes the fp32 weights
(Q4_0: (q - 8) d; Q4_1: q d + m, q the 4-bit value, the low nibbles the block's first 16, the high its
last 16; Q8_0: q d, q int8) and multiplies in x's type, accumulating in fp32.
"""

import triton
import triton.language as tl


@triton.jit
def _half(ptr, mask):
    """The fp16 at byte address ptr (little-endian, any alignment), as fp32 (0 where not `mask`)."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def block_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_x,
    stride_out,
    row_bytes,
    KIND: tl.constexpr,  # 0: Q4_0, 1: Q4_1, 2: Q8_0
    BLOCK_BYTES: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    within = tl.arange(0, BLOCK_K)  # BLOCK_K / 32 blocks of each output row a pass reads
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N]: each output row's bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + within
        k_ok = ks < k
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ok = k_ok[:, None] & col_ok[None, :]
        head = w_rows + (ks // 32)[:, None] * BLOCK_BYTES  # [BLOCK_K, BLOCK_N]: each value's block
        value = (ks % 32)[:, None]
        d = _half(head, ok)
        if KIND == 2:
            q = tl.load(head + 2 + value, mask=ok, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d
        else:
            packed = tl.load(head + (2 if KIND == 0 else 4) + value % 16, mask=ok, other=0)
            q = ((packed >> ((value // 16) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
            if KIND == 0:
                w = (q - 8.0) * d
            else:
                w = q * d + _half(head + 2, ok)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    targets = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(targets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
