"""The model's small ops against the plain torch / transformers arithmetic they stand in for."""

from __future__ import annotations

import platform

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.ops import linear, onednn_linear_available, pack_linear_weight, rms_norm, silu_and_mul


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 40), torch.randn(rows, 40)
    bias = torch.randn(96) if with_bias else None
    packed = pack_linear_weight(weight)
    assert packed.is_mkldnn == onednn_linear_available()  # the fast path is the one in use where it exists
    torch.testing.assert_close(linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN ships in x86 CPU builds of torch")
def test_x86_builds_have_the_packed_linear() -> None:
    assert onednn_linear_available()


def test_packing_leaves_other_dtypes_alone() -> None:
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert pack_linear_weight(weight) is weight
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight), torch.nn.functional.linear(x, weight))


def test_rms_norm_is_bit_identical_to_transformers() -> None:
    torch.manual_seed(0)
    reference = LlamaRMSNorm(64, eps=1e-6)
    reference.weight.data = torch.randn(64)
    x = torch.randn(33, 64) * 5
    assert torch.equal(rms_norm(x, reference.weight.data, 1e-6), reference(x).detach())


def test_silu_and_mul_matches_the_unfused_formula() -> None:
    gate_up = torch.randn(5, 16)
    assert torch.equal(silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :8]) * gate_up[:, 8:])
