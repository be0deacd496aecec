"""The Triton kernel behind `kernels.triton.lora` (imported only where triton is installed): a matmul over one
adapter's run of rows, read through the step's row order.

Program (pid, adapter): the pid-th (row block, output block) of that adapter's rows. Rows are gathered
through `order`, so an adapter's rows need not be contiguous in x or out; each output row is written by
exactly one program, and accumulation (expand's y += ...) reads it first, in fp32.
"""

import triton
import triton.language as tl


@triton.jit
def segment_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    order_ptr,
    starts_ptr,
    n,
    k,
    stride_x,
    stride_wa,
    stride_wn,
    stride_out,
    ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    adapter = tl.program_id(1)
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n, BLOCK_N)
    block_m, block_n = pid // n_blocks, pid % n_blocks
    first = tl.load(starts_ptr + adapter)
    end = tl.load(starts_ptr + adapter + 1)
    start = first + block_m * BLOCK_M
    if adapter == 0 or start >= end:  # the base model's rows, or past this adapter's run
        return
    picks = start + tl.arange(0, BLOCK_M)
    row_ok = picks < end
    rows = tl.load(order_ptr + picks, mask=row_ok, other=0).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + adapter.to(tl.int64) * stride_wa
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, w, input_precision=PRECISION)
    targets = out_ptr + rows[:, None] * stride_out + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(targets, mask=ok, other=0.0).to(tl.float32)
    tl.store(targets, acc.to(out_ptr.dtype.element_ty), mask=ok)
