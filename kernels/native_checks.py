"""What the C kernels' Python forms check of a tensor before they hand its memory to C (`kernels.native`,
`kernels.native_attention`): the C code trusts the layout it is given, so a wrong one is a ValueError
here rather than a read out of bounds there.
"""

from __future__ import annotations

import torch


def check(condition: bool, message: str) -> None:
    """ValueError(`message`) unless `condition` holds."""
    if not condition:
        raise ValueError(message)


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


def check_rows(x: torch.Tensor, name: str) -> None:
    """x is fp32 on the CPU, and contiguous within each row of its first dimension."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"{name} must be float32 on the CPU")
    if x.dim() < 1 or not rows_contiguous(x):
        raise ValueError(f"{name} must be contiguous within each row")
