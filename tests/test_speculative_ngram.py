"""Speculative decoding's pieces: the n-gram proposer (`procs.scheduler.speculation.ngram`) and the worker's
verification of proposed tokens (`SampleRows.accepted` / `kept`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchserve.procs.scheduler.speculation.ngram import MAX_PAUSE, NgramProposer, pause_after
from batchserve.procs.worker.sample_rows import SampleRows


def tokens(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def test_the_longest_match_wins_and_its_latest_occurrence() -> None:
    # "6 7 8" occurs at 0, "7 8" also at 7: the 3-gram's continuation is proposed.
    history = tokens(6, 7, 8, 3, 4, 5, 1, 7, 8, 9, 9, 9, 6, 7, 8)
    assert NgramProposer(3, 1, 3).propose(history, 10).tolist() == [3, 4, 5]
    # Up to 2-grams: the latest occurrence of "7 8", at 7.
    assert NgramProposer(3, 1, 2).propose(history, 10).tolist() == [9, 9, 9]


def test_a_proposal_is_cut_to_the_limit_and_to_what_follows() -> None:
    proposer = NgramProposer(5, 2, 4)
    history = tokens(1, 2, 3, 4, 5, 6, 7, 1, 2)
    assert proposer.propose(history, 2).tolist() == [3, 4]
    assert proposer.propose(history, 0).tolist() == []
    assert proposer.propose(tokens(1, 2, 3, 1, 2), 9).tolist() == [3, 1, 2]  # up to the history's end


def test_no_match_below_the_shortest_n_proposes_nothing() -> None:
    proposer = NgramProposer(4, 2, 4)
    assert proposer.propose(tokens(5, 1, 2, 3, 9, 3), 8).tolist() == []  # "9 3" never occurred; "3" alone is too short
    assert NgramProposer(4, 1, 4).propose(tokens(5, 1, 2, 3, 9, 3), 8).tolist() == [9, 3]
    assert proposer.propose(tokens(4), 8).tolist() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 4), st.integers(1, 6))
def test_the_proposal_is_what_followed_the_latest_occurrence_of_the_longest_suffix(history, a, b, k) -> None:
    """Against a plain search, for every history."""
    min_n, max_n = min(a, b), max(a, b)
    h = np.asarray(history, dtype=np.int32)
    expected: list[int] = []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(history):
            continue
        hits = [s for s in range(len(history) - n) if history[s : s + n] == history[-n:]]
        if hits:
            expected = history[hits[-1] + n : hits[-1] + n + k]
            break
    assert NgramProposer(k, min_n, max_n).propose(h, 99).tolist() == expected


def test_back_off_doubles_up_to_its_cap() -> None:
    assert [pause_after(m) for m in range(8)] == [0, 1, 2, 4, 8, 16, 32, 32]
    assert pause_after(100) == MAX_PAUSE


def rows(*rows: list[int]) -> SampleRows:
    """Rows of fed tokens (the last token, then the proposal), slots 0, 1, ..."""
    lens = np.asarray([len(r) for r in rows], dtype=np.int64)
    return SampleRows.build(
        np.arange(len(rows), dtype=np.int64),
        np.zeros(len(rows), dtype=np.int64),
        lens,
        np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]),
    )


def test_verification_keeps_each_position_while_the_token_before_it_was_proposed() -> None:
    r = rows([10, 5, 6, 7], [20], [30, 8, 9])
    # Row 0 sampled 5, 6 (as proposed), then 1 where 7 was proposed: 3 kept (5, 6, 1); its last position's
    # token would follow 7, which was never accepted.
    # Row 1 has nothing proposed: its one position. Row 2 sampled 4 where 8 was proposed: 1 kept.
    sampled = np.asarray([5, 6, 1, 2, 21, 4, 9, 0], dtype=np.int64)
    accepted = r.accepted(sampled)
    assert accepted.tolist() == [3, 1, 1]
    kept, index = r.kept(accepted)
    assert index.tolist() == [0, 1, 2, 4, 5]
    assert kept.lens.tolist() == [3, 1, 1] and kept.slots.tolist() == [0, 0, 0, 1, 2]
    assert kept.counts.tolist() == [0, 1, 2, 0, 0] and kept.fed.tolist() == [10, 5, 6, 20, 30]
    everything = np.asarray([5, 6, 7, 3, 21, 8, 9, 0], dtype=np.int64)
    assert r.accepted(everything).tolist() == [4, 1, 3]  # all proposed tokens, and the one after them


def test_rows_of_one_position_keep_it() -> None:
    r = rows([1], [2], [3])
    assert r.accepted(np.asarray([7, 8, 9])).tolist() == [1, 1, 1]
