"""Every Triton kernel the CUDA path launches, compiled for the H100 (sm_90) on this CPU machine (issue 69),
at the shapes of the models it serves and in the 16-bit types production runs: the launches are recorded
under the interpreter without running them (`tests/triton_launches.py`) and built in a fresh interpreter by
the ptxas inside the triton wheel; each must build and fit an H100 block's shared memory. What only a GPU can
check (speed, bf16 rounding, graphs) is listed in tests/gpu/README.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_launches import H100_SHARED_BYTES, compile_for_h100, recorded

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from batchserve.kernels.triton.lora import RowGroups, add_lora  # noqa: E402

# (hidden, intermediate) of Llama-3.2-1B, Llama-3-8B and Llama-3-70B; LoRA ranks as served (--max-lora-rank)
LORA_WIDTHS = [(2048, 8192), (4096, 14336), (8192, 28672)]
LORA_RANKS = [8, 16, 64]


def _lora_launches(dtype: torch.dtype) -> None:
    """Every projection's shrink and expand at each width and rank, decode (8 rows) and prefill (512 rows),
    the widest fused part (q|k|v, gate|up: 3 parts x rank columns) included; not run, only recorded."""
    for hidden, intermediate in LORA_WIDTHS:
        for rank in LORA_RANKS:
            for rows in (8, 512):
                groups = RowGroups.of(np.arange(rows) % 4, 4, torch.device("cpu"))
                for k, n, parts in ((hidden, hidden, 3), (hidden, 2 * intermediate, 2), (intermediate, hidden, 1)):
                    x = torch.empty((rows, k), dtype=dtype)
                    a = torch.empty((4, parts * rank, k), dtype=dtype)
                    b = torch.empty((4, n, parts * rank), dtype=dtype)
                    add_lora(x, a, b, groups, torch.empty((rows, n), dtype=dtype))


@pytest.mark.timeout(900)
def test_the_lora_kernels_build_for_h100_at_served_shapes():
    with recorded(run=False) as launches:
        for dtype in (torch.bfloat16, torch.float16):
            _lora_launches(dtype)
    results = compile_for_h100(launches)
    assert results and not [r for r in results if r["error"]], [r for r in results if r["error"]][:3]
    too_big = [r for r in results if r["shared"] > H100_SHARED_BYTES]
    assert not too_big, too_big[:3]
    assert {r["name"] for r in results} == {"segment_matmul_kernel"}
    assert len(results) >= 12  # block shapes by width and rank, two dtypes, accumulate or not


@triton.jit
def _narrow_dot(x_ptr, out_ptr, K: tl.constexpr):
    """What the interpreter runs and sm_90 refuses: tl.dot over K < 16."""
    rows = tl.arange(0, 16)
    ks = tl.arange(0, K)
    x = tl.load(x_ptr + rows[:, None] * K + ks[None, :])
    tl.store(out_ptr + rows[:, None] * 16 + rows[None, :], tl.dot(x, tl.trans(x)))


def test_the_compile_check_refuses_what_only_the_interpreter_accepts():
    x, out = torch.randn(16, 8), torch.empty(16, 16)
    with recorded() as launches:
        _narrow_dot[(1,)](x, out, K=8)
    assert torch.allclose(out, x @ x.T, atol=1e-5)  # the interpreter ran it
    (result,) = compile_for_h100(launches)
    assert result["error"] is not None and result["shared"] is None


# Qwen3-Next-80B-A3B / Qwen3.5's linear attention: 16 key heads, 32 value heads, 128 wide
GDN_HEADS, GDN_VALUE_HEADS, GDN_DIM = 16, 32, 128


def _gated_delta_launches(dtype: torch.dtype) -> None:
    """A step's packed prefill chunks (crossing fla's 64-token chunks) and a decode batch; recorded, not run."""
    from batchserve.kernels.triton.gated_delta import chunk_rule, recurrent_step

    def inputs(tokens: int) -> tuple[torch.Tensor, ...]:
        q, k = (torch.zeros(tokens, GDN_HEADS, GDN_DIM, dtype=dtype) for _ in range(2))
        v = torch.zeros(tokens, GDN_VALUE_HEADS, GDN_DIM, dtype=dtype)
        return q, k, v, torch.zeros(tokens, GDN_VALUE_HEADS), torch.zeros(tokens, GDN_VALUE_HEADS, dtype=dtype)

    bounds = torch.tensor([0, 150, 180], dtype=torch.int64)
    states = torch.zeros(2, GDN_VALUE_HEADS, GDN_DIM, GDN_DIM)
    chunk_rule(*inputs(180), states, bounds, bounds)
    recurrent_step(*inputs(8), torch.zeros(8, GDN_VALUE_HEADS, GDN_DIM, GDN_DIM))


@pytest.mark.timeout(900)
def test_the_gated_delta_kernels_build_for_h100_at_qwen3_next_heads():
    pytest.importorskip("fla")
    import triton_interpreter

    triton_interpreter.install()
    with recorded(run=False) as launches:
        for dtype in (torch.bfloat16, torch.float16):
            _gated_delta_launches(dtype)
    results = compile_for_h100(launches)
    assert len({r["name"] for r in results}) >= 4  # the chunked form's passes and the recurrent kernel
    assert not [r for r in results if r["error"]], [r for r in results if r["error"]][:3]
    too_big = [r for r in results if r["shared"] > H100_SHARED_BYTES]
    assert not too_big, too_big[:3]


def test_the_block_kernels_build_for_h100_at_8b_widths():
    """W4A16 / W8A16 over each block kind, Llama-3-8B's projections (4096 -> 6144 q|k|v, 4096 -> 28672 gate|up,
    14336 -> 4096 down), decode (8 rows) and prefill (512 rows) tiles, bf16 and fp16 activations."""
    from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockWeight
    from batchserve.kernels.triton.blocks import KINDS, block_matmul

    with recorded(run=False) as launches:
        for dtype in (torch.bfloat16, torch.float16):
            for kind in KINDS:
                block = BLOCK_TYPES[kind]
                for k, n in ((4096, 6144), (4096, 28672), (14336, 4096)):
                    weight = BlockWeight(torch.zeros((n, k // 32 * block.block_bytes), dtype=torch.uint8), block)
                    for rows in (8, 512):
                        block_matmul(torch.empty((rows, k), dtype=dtype), weight)
    results = compile_for_h100(launches)
    assert len(results) == 12  # 3 kinds x 2 dtypes x 2 row tiles
    assert not [r for r in results if r["error"]], [r for r in results if r["error"]][:3]
    assert max(r["shared"] for r in results) <= H100_SHARED_BYTES
