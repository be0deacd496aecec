"""What a step's time depends on, measured the same way where steps are timed (the worker's startup
probe) and where they are planned (the scheduler's step-cost model)."""

from __future__ import annotations

from collections.abc import Sequence


def attention_pairs(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> float:
    """Query-key pairs attention computes: a request feeding n tokens after p cached ones pairs its
    i-th new token with p + i keys, n * (p + (n + 1) / 2) in all (a decode row: its whole context)."""
    return float(sum(n * (p + (n + 1) / 2) for p, n in zip(prefix_lens, extend_lens)))


def experts_read(tokens: float, num_experts: int, top_k: int) -> float:
    """Experts a step's tokens are expected to read per mixture-of-experts layer, each token choosing
    top_k of num_experts at random: an expert is missed by all of them with probability (1 - k/E)^tokens.
    A decode step of one token reads k experts' weights, a large step all of them. 0 for a dense model."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
