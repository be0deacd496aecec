"""Prompt lookup (n-gram) drafts for speculative decoding (`--speculative ngram`).

A request's next tokens often repeat a stretch of what it has seen (a document it edits, quotes or
summarises; code it refactors; its own output): find the request's last n tokens earlier in its
prompt and output, and propose the tokens that followed them there (Saxena's prompt lookup decoding;
vLLM's and SGLang's `ngram`). The longest n in [min_n, max_n] that occurs wins, and its latest
occurrence. The target model verifies the proposal in one step (`SampleRows.accepted`), so a wrong
guess costs a wider row, never a different output.

A request whose proposals do not pay backs off: after a proposal with too few tokens accepted (no
more than `StepPlanner.min_acceptance` of them, a share the server's step-cost model sets: what a
token costs beside the step's tokens per second, small beside one request and near 1 in a big
batch) it skips 1, 2, 4 .. up to `MAX_PAUSE` steps before it tries again, so that text with no
repeats (where every row would only be wider) runs as plain decoding; one proposal that pays ends
the back-off.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_PAUSE = 32  # steps a request skips at most between two proposals after misses

_NO_TOKENS = np.zeros(0, dtype=np.int32)


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        """Up to `num_tokens` (>= 1) per proposal, from matches of `min_n` to `max_n` tokens (1 <= min_n
        <= max_n; `SchedulerConfig` checks them)."""
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, history: np.ndarray, limit: int, rid: str = "") -> np.ndarray:
        """At most min(num_tokens, limit) tokens to follow `history` (a request's prompt and output so
        far): what followed the latest earlier occurrence of its last n tokens; none if no n matches.
        (`rid` is the `Proposer` protocol's; prompt lookup needs no more than the history.)"""
        count = min(self.num_tokens, limit)
        length = history.shape[0]
        if count < 1:
            return _NO_TOKENS
        # Candidates: where the last token occurred before (cheap), then the longest n that matches.
        ends = np.flatnonzero(history[: length - 1] == history[length - 1])  # an occurrence's last index
        if not ends.shape[0]:
            return _NO_TOKENS
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = ends[ends >= n - 1] - (n - 1)
            if not starts.shape[0]:
                continue
            if n > 1:
                windows = sliding_window_view(history, n)[starts]
                starts = starts[(windows == history[length - n :]).all(axis=1)]
            if starts.shape[0]:
                follow = int(starts[-1]) + n
                return history[follow : follow + count].astype(np.int32, copy=False)
        return _NO_TOKENS


def pause_after(misses: int) -> int:
    """Proposals to skip (one a step) after `misses` drafts in a row that did not pay (0: none missed)."""
    return 0 if misses <= 0 else min(2 ** (misses - 1), MAX_PAUSE)
