"""Speculative decoding's verification rule, one place for the worker (`SampleRows.accepted`) and the
scheduler's scripted executor (`simulate`).

A row feeds its last token and then a draft d1 .. dk and samples a token at each of its k + 1
positions. Position 0 always counts; position j counts while the token sampled at position j - 1 is
d_j (so every counted token was sampled from the logits plain decoding would have had). With a
one-token-per-position proposal (prompt lookup) that is rejection sampling with a one-hot draft
distribution: d_j is kept with probability p(d_j), and a rejected position's sample is p without d_j,
renormalised (Leviathan et al.'s residual), so the output's distribution is the target's.
"""

from __future__ import annotations

import numpy as np

from batchserve.shared.ranges import concat_ranges


def accepted_lengths(sampled: np.ndarray, fed: np.ndarray, firsts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[rows] positions kept of each row (1 .. lens): `sampled` and `fed` hold every row's positions
    packed (row r's are firsts[r] .. firsts[r] + lens[r] - 1; `fed` the token fed at each)."""
    offsets = concat_ranges(0, lens)
    matches = np.zeros(sampled.shape[0], dtype=bool)
    matches[:-1] = sampled[:-1] == fed[1:]
    matches[firsts + lens - 1] = False  # a row's last position has nothing after it to vouch for
    return np.minimum.reduceat(np.where(matches, sampled.shape[0], offsets), firsts) + 1
