"""Gated DeltaNet's gated delta rule on flash-linear-attention's Triton kernels (fla-core 0.6.0): a step's
prefill chunks packed into one chunked-form call (`chunk_rule`, the sequences cut by `cu_seqlens`), its
one-token decode rows in one recurrent call (`recurrent_step`, a batch of rows with one token each).

The arithmetic is `kernels.gated_delta`'s: q and k L2-normed in the kernels (`use_qk_l2norm_in_kernel`, the
same x / sqrt(sum x^2 + 1e-6)), q scaled by key_dim ** -0.5, g the log decay and beta already computed by the
caller. fla takes the key heads as they are and lets consecutive value heads share one (value head h reads
key head h // (Hv / Hk)), our grouping, so q and k are not repeated. Its states are ours, [N, Hv, Dk, Dv]
fp32 (`state_v_first=False`): each sequence's state goes in as `initial_state` and its last comes back.
fla is imported inside the functions: it and triton are optional (the `gpu` extra).
"""

from __future__ import annotations

import torch

from batchserve.kernels.triton import LAUNCHES


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay) and beta [T, Hv], sequence i the rows
    cu_seqlens[i]:cu_seqlens[i + 1] (int64 [N + 1], on the tensors' device; `cu_seqlens_cpu`, the same on the
    host, spares fla reading it back), after states [N, Hv, Dk, Dv] fp32; (out [T, Hv, Dv] in q's dtype,
    the states after them [N, Hv, Dk, Dv] fp32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    LAUNCHES["gated_delta"] += 1
    out, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return out[0], final


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each row: q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta [B, Hv], after states
    [B, Hv, Dk, Dv] fp32; (out [B, Hv, Dv] in v's dtype, new states). The rows go in as a batch of
    one-token sequences: no cu_seqlens, nothing read back, so a CUDA graph can capture the call."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    LAUNCHES["gated_delta"] += 1
    out, final = fused_recurrent_gated_delta_rule(  # g and beta by name: gk and gv come between them
        q[:, None],
        k[:, None],
        v[:, None],
        g=g[:, None],
        beta=beta[:, None],
        scale=q.shape[-1] ** -0.5,
        initial_state=states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0], final
