"""The model's small ops against the plain torch / transformers arithmetic they stand in for."""

from __future__ import annotations

import platform

import pytest
import torch
from native_marks import requires_native_kernels
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from batchserve.kernels import native
from batchserve.kernels.ops import (
    add_rms_norm,
    apply_rotary,
    apply_rotary_torch,
    linear,
    onednn_linear_available,
    pack_linear_weight,
    rms_norm,
    rms_norm_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from batchserve.kernels.panel_linear import PanelWeight


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 40), torch.randn(rows, 40)
    bias = torch.randn(96) if with_bias else None
    packed = pack_linear_weight(weight)
    # the fastest path there is is the one in use: the C kernel's panels, else oneDNN's layout
    assert isinstance(packed, PanelWeight) == native.available()
    assert isinstance(packed, PanelWeight) or packed.is_mkldnn == onednn_linear_available()
    torch.testing.assert_close(linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))


def test_without_the_c_kernels_fp32_weights_take_onednns_layout(monkeypatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    weight, x = torch.randn(96, 40), torch.randn(3, 40)
    packed = pack_linear_weight(weight)
    assert packed.is_mkldnn == onednn_linear_available()
    torch.testing.assert_close(linear(x, packed), torch.nn.functional.linear(x, weight))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN ships in x86 CPU builds of torch")
def test_x86_builds_have_the_packed_linear() -> None:
    assert onednn_linear_available()


def test_packing_leaves_other_dtypes_alone() -> None:
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert pack_linear_weight(weight) is weight
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight), torch.nn.functional.linear(x, weight))


def test_torch_rms_norm_is_bit_identical_to_transformers() -> None:
    torch.manual_seed(0)
    reference = LlamaRMSNorm(64, eps=1e-6)
    reference.weight.data = torch.randn(64)
    x = torch.randn(33, 64) * 5
    assert torch.equal(rms_norm_torch(x, reference.weight.data, 1e-6), reference(x).detach())


def test_torch_silu_and_mul_matches_the_unfused_formula() -> None:
    gate_up = torch.randn(5, 16)
    assert torch.equal(silu_and_mul_torch(gate_up), torch.nn.functional.silu(gate_up[:, :8]) * gate_up[:, 8:])


# The C kernels (fp32 CPU) against the torch forms, on strided rows as the model hands them over
# and at sizes that split over threads (prefill) and leave a tail past the last 8-float vector.


@requires_native_kernels
@pytest.mark.parametrize("rows,dim", [(1, 576), (33, 64), (600, 100), (3, 7)])
def test_native_rms_norm_is_within_a_few_ulp_of_torch(rows: int, dim: int) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, dim + 5) * 3)[:, 2 : dim + 2]
    weight = torch.randn(dim)
    out = rms_norm(x, weight, 1e-6)
    assert native.applies_to(x) and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_torch(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


@requires_native_kernels
@pytest.mark.parametrize("rows,dim", [(1, 576), (32, 576), (600, 100), (3, 7)])
def test_native_add_rms_norm_adds_exactly_and_norms_within_a_few_ulp(rows: int, dim: int) -> None:
    torch.manual_seed(dim)
    x, residual, weight = torch.randn(rows, dim) * 3, torch.randn(rows, dim), torch.randn(dim)
    expected_sum = x + residual
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    assert summed is x and torch.equal(x, expected_sum)  # in place, and the add rounds as torch's does
    torch.testing.assert_close(normed, rms_norm_torch(expected_sum, weight, 1e-6), rtol=1e-6, atol=1e-6)


@requires_native_kernels
@pytest.mark.parametrize("rows,half", [(1, 1536), (5, 8), (300, 203)])
def test_native_silu_and_mul_is_close_to_torch(rows: int, half: int) -> None:
    torch.manual_seed(half)
    gate_up = torch.randn(rows, 2 * half + 3)[:, : 2 * half] * 8  # strided rows
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past exp's clamp range, and zeros
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up), rtol=3e-7, atol=1e-7)


@requires_native_kernels
@pytest.mark.parametrize("rows,heads,head_dim", [(1, 12, 64), (40, 3, 16), (700, 15, 64)])
def test_native_rotary_is_bit_identical_to_torch(rows: int, heads: int, head_dim: int) -> None:
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2) * head_dim)
    x = qkv[:, : heads * head_dim].view(rows, heads, head_dim)  # strided rows, as q|k inside the qkv output
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_torch(x, cos, sin))


@requires_native_kernels
def test_native_kv_write_matches_index_copy() -> None:
    pool_k, pool_v = torch.zeros(6, 4, 3, 8), torch.zeros(6, 4, 3, 8)
    kv = torch.randn(5, 7, 8)[:, :6]  # k and v as strided views of one projection output
    k, v = kv[:, :3], kv[:, 3:]
    locs = torch.tensor([23, 4, 5, 0, 17])
    native.write_kv(pool_k, pool_v, locs, k, v)
    expected_k, expected_v = (
        torch.zeros(24, 3, 8).index_copy_(0, locs, k),
        torch.zeros(24, 3, 8).index_copy_(0, locs, v),
    )
    assert torch.equal(pool_k.flatten(0, 1), expected_k) and torch.equal(pool_v.flatten(0, 1), expected_v)
    with pytest.raises(ValueError, match="outside the pool"):
        native.write_kv(pool_k, pool_v, torch.tensor([0, 1, 2, 3, 24]), k, v)
    with pytest.raises(ValueError, match="tokens, kv_heads, head_dim"):
        native.write_kv(pool_k, pool_v, locs[:4], k, v)


@requires_native_kernels
def test_native_ops_refuse_what_they_cannot_take() -> None:
    with pytest.raises(ValueError, match="float32"):
        native.rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="contiguous within each row"):
        native.rms_norm(torch.randn(8, 3).t(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="head_dim even"):
        native.rotary(torch.randn(2, 1, 5), torch.randn(2, 5), torch.randn(2, 5))
    # the dispatching ops take the torch form for what the kernels do not cover
    x = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(
        rms_norm(x, torch.ones(6, dtype=torch.float64), 1e-6),
        rms_norm_torch(x, torch.ones(6, dtype=torch.float64), 1e-6),
    )
