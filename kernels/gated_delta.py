"""Gated DeltaNet's token mixing (Qwen3.5 / Qwen3-Next linear attention) in plain torch, on one request's
packed tokens or on a batch of one-token decode rows, with each request's recurrent state passed in and
returned: the short causal convolution over q | k | v (its state: the last `width` inputs) and the gated
delta rule (its state: a [key_dim, value_dim] matrix per value head).

The arithmetic is transformers' torch reference (`torch_chunk_gated_delta_rule` for a sequence, 64 tokens a
chunk, `torch_recurrent_gated_delta_rule` for one token, `causal_conv1d_fn` / `_update`): q and k
L2-normed in fp32, q scaled by key_dim ** -0.5, the state decayed by exp(g) and corrected by
beta * (v - S^T k) k^T per token, read by q. The state matrices are fp32, as there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchserve.shared.step_features import LINEAR_ATTENTION_CHUNK

CHUNK = LINEAR_ATTENTION_CHUNK  # tokens per chunk of the chunked form, transformers' and flash-linear-attention's


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim, as flash-linear-attention computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens x [T, C] through the depthwise causal convolution `weight` [C, K] after its
    last K - 1 inputs `state` [C, K - 1], then SiLU; (out [T, C], the new state [C, K - 1])."""
    width = weight.shape[1] - 1
    inputs = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=1)  # [C, K - 1 + T]
    out = F.conv1d(inputs[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).transpose(0, 1), inputs[:, inputs.shape[1] - width :]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each row, x [B, C], after each row's state [B, C, K - 1]; (out [B, C], new states)."""
    inputs = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    return F.silu((inputs * weight).sum(dim=-1)), inputs[:, :, 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k grouped to the value heads (each key head serves consecutive value heads), normed, in fp32;
    q scaled by key_dim ** -0.5."""
    groups = v.shape[-2] // k.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float()


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each row: q, k [B, Hk, Dk], v [B, Hv, Dv], g (log decay) and beta [B, Hv], states
    [B, Hv, Dk, Dv] fp32; (out [B, Hv, Dv] fp32, new states)."""
    q, k, v = _prepare(q, k, v)
    state = state * g.float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # what the state holds for k: [B, Hv, Dv]
    delta = (v - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv], after its state [Hv, Dk, Dv]
    (fp32); (out [T, Hv, Dv] fp32, the state after them). Within a chunk the delta rule's updates are one
    triangular solve (the UT transform); the chunks run in order, each reading the state the last left."""
    length = q.shape[0]
    q, k, v = (x.transpose(0, 1) for x in _prepare(q, k, v))  # [H, T, D]
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [H, T]
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, chunks = q.shape[0], (length + pad) // chunk
    q, k, v = (x.reshape(heads, chunks, chunk, -1) for x in (q, k, v))
    k_beta, v_beta = k * beta.reshape(heads, chunks, chunk, 1), v * beta.reshape(heads, chunks, chunk, 1)
    decay = g.reshape(heads, chunks, chunk).cumsum(dim=-1)  # log decay from the chunk's start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    within = (q @ k.transpose(-1, -2)) * pair_decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    state = state.float()
    for i in range(chunks):
        corrected = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + within[:, i] @ corrected
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ corrected
    return out.reshape(heads, chunks * chunk, -1)[:, :length].transpose(0, 1), state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The output norm: RMSNorm of each head's x [..., D] (fp32) times weight [D], times SiLU(gate), in
    the gate's dtype (transformers' Qwen3_5RMSNormGated)."""
    dtype = gate.dtype
    x = x.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
