"""bench_engine's token comparison: generate's min_new_tokens bans EOS, the engine does not, so the
two agree up to the engine's EOS."""

from batchserve.loadtests.bench_engine import same_greedy_tokens


def test_tokens_agree_up_to_the_engines_eos() -> None:
    assert same_greedy_tokens([5, 6, 7], [5, 6, 7], (2,))
    assert same_greedy_tokens([5, 6, 2, 9], [5, 6, 198, 4], (2,))  # generate took the runner-up of EOS
    assert not same_greedy_tokens([5, 6, 7], [5, 8, 7], (2,))
    assert not same_greedy_tokens([5, 2], [6, 198], (2,))
