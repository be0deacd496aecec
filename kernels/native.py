"""CPU kernels in C (`kernels/csrc/`), compiled on first use with the machine's C compiler and called
through ctypes on the tensors' memory.

Why C and not torch ops: a CPU decode step is many small ops, and some of them (paged attention)
have no torch form that avoids copying. A few hundred lines of plain C with OpenMP do better. Why
not a torch C++ extension: compiling against torch's headers is slow on every fresh machine; plain C
builds at once and needs no Python headers.

This module is the kernels' Python forms, each checking what its C function trusts, and callers reach
every kernel through it (`native.X`). Beside it: how the library is built, cached and loaded
(`kernels.native_build`: `library()` is None where no compiler works or `BATCHSERVE_NATIVE_KERNELS=0`,
and callers then keep their torch path), the paged-attention kernels' forms (`kernels.native_attention`),
and the checks every form makes of its tensors (`kernels.native_checks`).
"""

from __future__ import annotations

import torch

from batchserve.kernels.native_attention import (  # noqa: F401 (every kernel is reached as native.X)
    check_locs,
    check_pages,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from batchserve.kernels.native_build import (  # noqa: F401 (the build's names callers reach as native.X)
    BASE_FLAGS,
    DISABLE_ENV,
    SIGNATURES,
    SOURCE_DIR,
    NativeKernelError,
    _build,
    _load,
    available,
    compiler,
    disabled,
    has_wide_vectors,
    library,
    loaded_library,
)
from batchserve.kernels.native_checks import check, check_rows, rows_contiguous  # noqa: F401 (native.rows_contiguous)


def applies_to(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels can take these tensors: fp32 on the CPU, and the kernels built."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return available()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [rows, n] (rows may be strided), with torch's ties and NaN answer."""
    check(x.dim() == 2 and x.shape[1] > 0, "x must be [rows, n] with n > 0")
    check_rows(x, "x")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    loaded_library().argmax_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], out.data_ptr())
    return out


def apply_token_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf in scores [rows, vocab] (rows may be strided) where bitmask [rows, words] int32 has a 0 bit;
    returns a bool [rows]: the rows with no finite allowed score left."""
    rows, vocab = scores.shape
    check(
        bitmask.dtype is torch.int32
        and bitmask.is_cpu
        and bitmask.is_contiguous()
        and bitmask.shape[0] == rows
        and bitmask.shape[1] * 32 >= vocab,
        "bitmask [rows, >= vocab / 32] int32",
    )
    check_rows(scores, "scores")
    dead = torch.empty(rows, dtype=torch.bool)
    loaded_library().apply_token_bitmask(
        scores.data_ptr(), rows, scores.stride(0), vocab, bitmask.data_ptr(), bitmask.shape[1], dead.data_ptr()
    )
    return dead


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [rows, dim] (rows may be strided) -> a new contiguous [rows, dim]."""
    check(x.dim() == 2 and weight.shape == x.shape[1:] and weight.is_contiguous(), "x [rows, dim], weight [dim]")
    check_rows(x, "x")
    check_rows(weight, "weight")
    out = torch.empty(x.shape, dtype=torch.float32)
    loaded_library().rms_norm(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), x.shape[1], eps, out.data_ptr())
    return out


def rms_norm_groups(x: torch.Tensor, groups: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each of the `groups` equal runs of each row of x [rows, groups * dim] (rows may be
    strided), all by weight [dim] -> a new contiguous [rows, groups * dim]."""
    check(
        x.dim() == 2 and groups >= 1 and x.shape[1] % groups == 0 and weight.shape == (x.shape[1] // groups,),
        "x [rows, groups * dim], weight [dim]",
    )
    check_rows(x, "x")
    check_rows(weight, "weight")
    out = torch.empty(x.shape, dtype=torch.float32)
    loaded_library().rms_norm_groups(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        groups,
        weight.shape[0],
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        x.shape[1],
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x += residual in place (both contiguous [rows, dim]), then (RMSNorm(x) as a new tensor, x)."""
    check(
        x.dim() == 2 and residual.shape == x.shape and weight.shape == x.shape[1:],
        "x and residual [rows, dim], weight [dim]",
    )
    check(x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous(), "x, residual, weight contiguous")
    size = x.numel() * x.element_size()
    check(
        x.data_ptr() + size <= residual.data_ptr() or residual.data_ptr() + size <= x.data_ptr() or size == 0,
        "x and residual must not overlap",
    )
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        check_rows(t, name)
    out = torch.empty(x.shape, dtype=torch.float32)
    loaded_library().add_rms_norm(
        x.data_ptr(), residual.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr()
    )
    return out, x


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [rows, heads, head_dim] by cos/sin [rows, head_dim]."""
    rows, heads, head_dim = x.shape
    check(
        cos.shape == sin.shape == (rows, head_dim)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and head_dim % 2 == 0,
        "cos and sin must be contiguous [rows, head_dim], head_dim even",
    )
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        check_rows(t, name)
    out = torch.empty(x.shape, dtype=torch.float32)
    loaded_library().rotary(
        x.data_ptr(), rows, x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), out.data_ptr()
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [rows, 2 * half] (rows may be strided) -> [rows, half]."""
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up must be [rows, 2 * half]")
    check_rows(gate_up, "gate_up")
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, half), dtype=torch.float32)
    loaded_library().silu_and_mul(gate_up.data_ptr(), rows, gate_up.stride(0), half, out.data_ptr())
    return out


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One input of each row (x [rows, >= channels], its first `channels`) through the causal convolution
    weight [channels, K] and SiLU, after the rows' windows pool[slots] [channels, K - 1], which move on in
    place -> out [rows, channels]."""
    rows, (channels, taps) = x.shape[0], weight.shape
    check(
        x.dim() == 2
        and x.shape[1] >= channels
        and weight.is_contiguous()
        and pool.is_contiguous()
        and pool.shape[1:] == (channels, taps - 1),
        "x [rows, >= C], weight [C, K], pool [slots, C, K - 1]",
    )
    _check_slots(slots, rows, pool.shape[0])
    for name, t in (("x", x), ("weight", weight), ("pool", pool)):
        check_rows(t, name)
    out = torch.empty((rows, channels), dtype=torch.float32)
    loaded_library().causal_conv1d_decode(
        x.data_ptr(),
        rows,
        x.stride(0),
        weight.data_ptr(),
        channels,
        taps - 1,
        pool.data_ptr(),
        slots.data_ptr(),
        out.data_ptr(),
    )
    return out


def _check_slots(slots: torch.Tensor, rows: int, pool_slots: int) -> None:
    check(
        slots.dtype is torch.int64
        and slots.is_contiguous()
        and slots.shape == (rows,)
        and (rows == 0 or 0 <= int(slots.min()) and int(slots.max()) < pool_slots),
        "slots: int64 rows of pool",
    )


def gated_delta_decode(
    mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, key_heads: int
) -> torch.Tensor:
    """One token of each row (mixed [rows, q | k | v], g and beta [rows, value_heads]) through the gated delta
    rule, updating the rows' states pool[slots] [value_heads, dk, dv] in place -> out [rows, value_heads, dv]."""
    rows = mixed.shape[0]
    _, value_heads, dk, dv = pool.shape
    check(
        mixed.dim() == 2 and mixed.shape[1] == 2 * key_heads * dk + value_heads * dv and value_heads % key_heads == 0,
        "mixed must be [rows, 2 * key_heads * dk + value_heads * dv]",
    )
    check(
        g.shape == beta.shape == (rows, value_heads) and g.is_contiguous() and beta.is_contiguous(),
        "g and beta must be contiguous [rows, value_heads]",
    )
    check(pool.is_contiguous(), "pool must be contiguous")
    _check_slots(slots, rows, pool.shape[0])
    for name, t in (("mixed", mixed), ("g", g), ("beta", beta), ("pool", pool)):
        check_rows(t, name)
    out = torch.empty((rows, value_heads, dv), dtype=torch.float32)
    loaded_library().gated_delta_decode(
        mixed.data_ptr(),
        rows,
        mixed.stride(0),
        g.data_ptr(),
        beta.data_ptr(),
        pool.data_ptr(),
        slots.data_ptr(),
        key_heads,
        value_heads,
        dk,
        dv,
        out.data_ptr(),
    )
    return out


PANEL = 16  # output columns per packed weight panel (PANEL in csrc/panel_linear.c)


def check_panels(packed: torch.Tensor, scale: torch.Tensor | None, out_features: int) -> None:
    """The layout `panel_linear` trusts: packed [panels, in, PANEL] fp32, or int8 with scale [panels * PANEL]
    fp32, covering out_features columns."""
    check(
        packed.dim() == 3
        and packed.shape[2] == PANEL
        and packed.is_contiguous()
        and packed.is_cpu
        and packed.dtype in (torch.float32, torch.int8),
        "packed must be [panels, in, 16] fp32 or int8",
    )
    check(packed.shape[0] * PANEL >= out_features > (packed.shape[0] - 1) * PANEL, "out_features")
    check(
        packed.dtype != torch.int8
        or (
            scale is not None
            and scale.shape == (packed.shape[0] * PANEL,)
            and scale.dtype == torch.float32
            and scale.is_contiguous()
        ),
        "int8 panels need scale [panels * 16] fp32",
    )


def panel_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    *,
    panels_checked: bool = False,
) -> torch.Tensor:
    """x [m, in] (rows may be strided) times a weight packed by `kernels.panel_linear.pack_panels`
    (packed [panels, in, PANEL] fp32, or int8 with scale [panels * PANEL]), plus bias [out]: [m, out] fp32.
    `panels_checked`: the caller ran `check_panels` on this weight already (the per-call checks of an
    unchanging weight cost about as much as the kernel itself on a decode row)."""
    if not panels_checked:
        check_panels(packed, scale, out_features)
    check(x.dim() == 2 and x.shape[1] == packed.shape[1], "x must be [m, in]")
    check_rows(x, "x")
    if bias is not None:
        check(
            bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_contiguous(),
            "bias must be [out] fp32",
        )
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    bias_ptr = bias.data_ptr() if bias is not None else None
    if packed.dtype == torch.int8:
        assert scale is not None  # `check_panels`: int8 panels come with their scale
        loaded_library().int8_linear(
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            packed.data_ptr(),
            scale.data_ptr(),
            bias_ptr,
            out_features,
            x.shape[1],
            out.data_ptr(),
        )
    else:
        loaded_library().f32_linear(
            x.data_ptr(), x.shape[0], x.stride(0), packed.data_ptr(), bias_ptr, out_features, x.shape[1], out.data_ptr()
        )
    return out
