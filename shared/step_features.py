"""What a step's time depends on, measured the same way where steps are timed (the worker's startup
probe) and where they are planned (the scheduler's step-cost model)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np

# Tokens per chunk of a linear-attention layer's chunked form (`kernels.gated_delta`): a row of n > 1 tokens
# computes ceil(n / 64) whole chunks, so 16 tokens cost what 64 do.
LINEAR_ATTENTION_CHUNK = 64


class StepShape(msgspec.Struct, frozen=True, array_like=True):
    """What a step's time depends on (`step_shape`); shapes add up (a step's decodes and a chunk beside them)."""

    tokens: float = 0.0  # tokens fed: the linear layers' rows
    rows: float = 0.0  # requests: each samples (the LM head, the sampler) and is a row of every kernel
    pairs: float = 0.0  # attention query-key pairs per layer on average (`attention_pairs`)
    chunked: float = 0.0  # linear-attention layers' chunked-form tokens (`linear_chunked_tokens`)

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(
            self.tokens + other.tokens, self.rows + other.rows, self.pairs + other.pairs, self.chunked + other.chunked
        )


def step_shape(
    prefix_lens: Sequence[int] | np.ndarray, extend_lens: Sequence[int] | np.ndarray, windows: Sequence[int] = ()
) -> StepShape:
    """The shape of a step whose rows feed `extend_lens` tokens after `prefix_lens` cached ones, in a model
    whose layers have `windows` (`layer_cost_windows`)."""
    n = np.asarray(extend_lens, dtype=np.float64)
    return StepShape(
        float(n.sum()),
        float(np.count_nonzero(n)),
        attention_pairs(prefix_lens, n, windows),
        linear_chunked_tokens(n, windows),
    )


def linear_chunked_tokens(extend_lens: np.ndarray, windows: Sequence[int]) -> float:
    """The tokens a hybrid model's linear-attention layers compute in the chunked form, per layer on average:
    rows of more than one token, each padded to whole chunks (one-token rows take the recurrent form, whose
    per-row cost the state's pairs count). 0 for a model without linear layers."""
    linear = sum(1 for w in windows if w < 0)
    if not linear:
        return 0.0
    chunks = np.ceil(extend_lens[extend_lens > 1] / LINEAR_ATTENTION_CHUNK)
    return float(chunks.sum()) * LINEAR_ATTENTION_CHUNK * linear / len(windows)


def attention_pairs(
    prefix_lens: Sequence[int] | np.ndarray, extend_lens: Sequence[int] | np.ndarray, windows: Sequence[int] = ()
) -> float:
    """Query-key pairs attention computes, per layer on average: a request feeding n tokens after p cached
    ones pairs its i-th new token (i = 1..n) with p + i keys, n * (p + (n + 1) / 2) in all (a decode row:
    its whole context); in a layer with a sliding window W, with min(p + i, W) keys; in a linear-attention
    layer (a window of -K, `layer_cost_windows`) K per request, whatever its tokens (its state is read once
    a step). `windows`: each layer's (0: none; empty: no layer slides or is linear)."""
    p = np.asarray(prefix_lens, dtype=np.float64)
    n = np.asarray(extend_lens, dtype=np.float64)
    full = float((n * (p + (n + 1) / 2)).sum())
    if not any(windows):
        return full
    total = 0.0
    for window, layers in Counter(windows).items():
        if not window:
            total += layers * full
            continue
        if window < 0:
            total += layers * -window * float(np.count_nonzero(n))
            continue
        first, last = p + 1, p + n  # the keys of the first and the last new token, unwindowed
        inside = np.clip(np.minimum(last, window) - first + 1, 0, None)  # tokens with fewer keys than the window
        total += layers * float((inside * (first + np.minimum(last, window)) / 2 + (n - inside) * window).sum())
    return total / len(windows)


# A decode row reads a linear-attention layer's state twice and writes it once; attention reads a key once.
STATE_PASSES = 3


def layer_cost_windows(
    windows: Sequence[int], linear_layers: Sequence[int], num_layers: int, state_bytes: int, key_bytes: int
) -> tuple[int, ...]:
    """Each layer's window as the step-cost model counts attention pairs (`attention_pairs`): its sliding
    window (0: none), and for a hybrid model's linear-attention layer -K, K the keys whose K/V reads cost
    what its state's passes do (`state_bytes` per request and layer, `key_bytes` a token's K and V in one
    layer): a request's row there reads its state once, whatever its tokens and context (the per-token
    work is the linear layers', which the tokens term counts). Empty: no layer slides and none is linear."""
    if not linear_layers:
        return tuple(windows)
    keys = -max(1, round(STATE_PASSES * state_bytes / key_bytes))
    base, linear = tuple(windows) or (0,) * num_layers, set(linear_layers)
    return tuple(keys if layer in linear else base[layer] for layer in range(num_layers))


def experts_read(tokens: float, num_experts: int, top_k: int) -> float:
    """Experts a step's tokens are expected to read per mixture-of-experts layer, each token choosing
    top_k of num_experts at random: an expert is missed by all of them with probability (1 - k/E)^tokens.
    A decode step of one token reads k experts' weights, a large step all of them. 0 for a dense model."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
