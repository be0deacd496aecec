"""Multi-LoRA's two matmuls on CUDA, over a step's rows grouped by adapter: shrink (t = x . A^T, to the rank)
and expand (y += t . B^T, back to the projection's outputs), one Triton kernel for both.

The rows are not moved: `RowGroups` lists them sorted by adapter (`order`) and where each adapter's run
starts (`starts`, one more than the adapter count), and each program reads its rows through that list. The
grid is (row blocks x output blocks, adapters): fixed by the step's row count and the adapter count alone,
so a captured CUDA graph replays for any mix of adapters once the two index arrays are copied in (the
adapter of each row is a graph input). Adapter 0 is the base model: its programs return at once, and a
program past its adapter's last row does too. Rows of an adapter of a lower rank read zeros past it (the
stacks are zero-padded to the highest rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.kernels.triton import LAUNCHES

BLOCK_M = 16  # rows a program takes: decode steps have few rows per adapter; tl.dot wants >= 16


@dataclass
class RowGroups:
    """A step's rows grouped by adapter: `order` [rows] int32, the rows sorted by adapter (stable);
    `starts` [adapters + 1] int32, where each adapter's run begins in `order` (the last: the row count)."""

    order: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def of(cls, row_adapter: np.ndarray, adapters: int, device: torch.device) -> RowGroups:
        """The groups of rows whose adapters are `row_adapter` (0: none), for stacks of `adapters` entries."""
        order = np.argsort(row_adapter, kind="stable").astype(np.int32)
        starts = np.searchsorted(row_adapter[order], np.arange(adapters + 1)).astype(np.int32)
        return cls(torch.from_numpy(order).to(device), torch.from_numpy(starts).to(device))

    def copy_(self, other: RowGroups) -> None:
        """`other`'s contents into these tensors (their addresses, which a captured graph reads, kept)."""
        self.order[: other.order.shape[0]].copy_(other.order)
        self.starts.copy_(other.starts)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block(size: int) -> int:
    return min(64, max(16, 1 << (size - 1).bit_length()))


def grouped_matmul(
    x: torch.Tensor, weights: torch.Tensor, groups: RowGroups, out: torch.Tensor, accumulate: bool
) -> torch.Tensor:
    """out[r] (+)= x[r] . weights[a]^T for each row r of adapter a >= 1 in `groups`: x [rows, K],
    weights [adapters, N, K], out [rows, N]; rows of adapter 0 are left as they are."""
    from batchserve.kernels.triton.lora_kernel import segment_matmul_kernel

    rows, k = x.shape
    adapters, n, _ = weights.shape
    block_n, block_k = _block(n), _block(k)
    grid = (_cdiv(rows, BLOCK_M) * _cdiv(n, block_n), adapters)
    segment_matmul_kernel[grid](
        x,
        weights,
        out,
        groups.order,
        groups.starts,
        n,
        k,
        x.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        ACCUMULATE=accumulate,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32 rounding)
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    LAUNCHES["lora"] += 1
    return out


def add_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: RowGroups, out: torch.Tensor) -> torch.Tensor:
    """out += (x . A[a]^T) . B[a]^T for each row's adapter a: a [adapters, rank, in], b [adapters, out, rank]."""
    shrunk = torch.zeros((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    grouped_matmul(x, a, groups, shrunk, accumulate=False)
    return grouped_matmul(shrunk, b, groups, out, accumulate=True)
