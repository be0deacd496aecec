"""Tests for kernels.sampling.sample_batch: filters, seeds and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from batchserve.kernels.sampling import sample_batch
from batchserve.shared.messages import SamplingParams

VOCAB = 8
DRAWS = 20_000
# Chi-square critical value for 7 degrees of freedom at p = 0.001; the seeds are fixed, so a pass is
# deterministic, and a broken sampler (wrong temperature, biased noise) exceeds it by far.
CHI2_CRITICAL_DF7 = 24.32


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


def _chi2_critical(df: int) -> float:
    # Wilson-Hilferty approximation of the p = 0.001 quantile (z = 3.09).
    return df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3


def _draws(logits_row: torch.Tensor, params: SamplingParams, count: int = DRAWS) -> torch.Tensor:
    logits = logits_row.unsqueeze(0).expand(count, -1).contiguous()
    return sample_batch(logits, [params] * count, [0] * count)


@pytest.fixture
def row() -> torch.Tensor:
    return torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def test_all_greedy_is_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    out = sample_batch(logits, [SamplingParams(temperature=0.0)] * 16, list(range(16)))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(2)) * 3
    greedy = logits.argmax(dim=-1)
    variants = [
        SamplingParams(top_k=1),
        SamplingParams(top_k=1, seed=5),
        SamplingParams(top_p=1e-6),
        SamplingParams(top_p=1e-6, temperature=2.0, seed=9),
        SamplingParams(top_k=1, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.0),
    ]
    params = [variants[i % len(variants)] for i in range(64)]
    for step in range(5):
        out = sample_batch(logits, params, [step] * 64)
        assert torch.equal(out, greedy)


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = sample_batch(logits, params, [0] * 6)
    assert torch.equal(out[0::2], logits[0::2].argmax(dim=-1))


def test_seeded_request_ignores_batch_neighbours_and_row() -> None:
    gen = torch.Generator().manual_seed(4)
    target_logits = torch.randn(500, generator=gen)
    seeded = [
        SamplingParams(seed=1234),
        SamplingParams(seed=77, top_k=20),
        SamplingParams(seed=2**40 + 3, top_p=0.9, temperature=0.7),
        SamplingParams(seed=0, min_p=0.05, top_k=100, top_p=0.95),
    ]
    neighbours = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.5, seed=99),
        SamplingParams(min_p=0.2),
    ]
    for target in seeded:
        sequences = []
        for layout in range(3):
            tokens = []
            for count in range(12):
                n_before = layout * 2
                others = torch.randn(len(neighbours), 500, generator=gen)
                logits = torch.cat([others[:n_before], target_logits.unsqueeze(0), others[n_before:]])
                params = neighbours[:n_before] + [target] + neighbours[n_before:]
                counts = [count + 100 * layout] * n_before + [count] + [7] * (len(neighbours) - n_before)
                tokens.append(int(sample_batch(logits, params, counts)[n_before]))
            sequences.append(tokens)
        assert sequences[0] == sequences[1] == sequences[2]
        # The count advances the generator: a sequence of 12 draws is not one repeated token.
        if target.top_k != 20:
            assert len(set(sequences[0])) > 1


def test_one_requests_consecutive_positions_sample_as_single_steps() -> None:
    """A decode row of k positions gives one request k rows with counts c .. c + k - 1: each row
    samples what a single-row step at its count does (the counter is per sampled position)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=42)] * 4 + [SamplingParams(temperature=1.0, seed=3)] * 2
    counts = [9, 10, 11, 12, 0, 1]
    together = sample_batch(logits, params, counts).tolist()
    assert together == [int(sample_batch(logits[i : i + 1], params[i : i + 1], counts[i : i + 1])) for i in range(6)]


def test_different_seeds_give_different_draws(row: torch.Tensor) -> None:
    logits = row.unsqueeze(0).expand(200, -1).contiguous()
    out = sample_batch(logits, [SamplingParams(seed=s) for s in range(200)], [0] * 200)
    assert len(set(out.tolist())) >= 5


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=3),
        SamplingParams(top_k=3, seed=11),
        SamplingParams(min_p=0.3),
        SamplingParams(min_p=0.3, seed=12, temperature=1.7),
        SamplingParams(top_p=0.7),
        SamplingParams(top_k=5, top_p=0.9, min_p=0.2, temperature=3.0),
    ],
)
def test_filtered_tokens_are_never_sampled(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(400, 64, generator=gen) * 2
    counts = list(range(400))
    allowed = _allowed_tokens(logits, params)
    for _ in range(5):
        out = sample_batch(logits, [params] * 400, counts)
        assert allowed.gather(1, out.unsqueeze(1)).all()
        counts = [c + 400 for c in counts]


def _allowed_tokens(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference filter mask, written per row with plain sorting (vLLM's order of filters)."""
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for r in range(logits.shape[0]):
        probs = (logits[r] / params.temperature).softmax(dim=-1)
        order = probs.argsort(descending=True)
        keep = order[: params.top_k] if params.top_k > 0 else order
        kept = probs[keep] / probs[keep].sum()
        mass_before = kept.cumsum(0) - kept
        keep = keep[mass_before < params.top_p]
        keep = keep[probs[keep] >= params.min_p * probs.max()]
        allowed[r, keep] = True
    return allowed


def test_temperature_one_matches_softmax_unseeded(row: torch.Tensor) -> None:
    torch.manual_seed(6)
    tokens = _draws(row, SamplingParams())
    assert _chi_square(tokens, row.softmax(-1)) < CHI2_CRITICAL_DF7


def test_temperature_one_matches_softmax_across_seeds(row: torch.Tensor) -> None:
    logits = row.unsqueeze(0).expand(DRAWS, -1).contiguous()
    params = [SamplingParams(seed=s) for s in range(DRAWS)]
    tokens = sample_batch(logits, params, [0] * DRAWS)
    assert _chi_square(tokens, row.softmax(-1)) < CHI2_CRITICAL_DF7


def test_one_seeded_request_over_its_steps_matches_softmax(row: torch.Tensor) -> None:
    logits = row.unsqueeze(0).expand(DRAWS, -1).contiguous()
    tokens = sample_batch(logits, [SamplingParams(seed=31337)] * DRAWS, list(range(DRAWS)))
    assert _chi_square(tokens, row.softmax(-1)) < CHI2_CRITICAL_DF7


@pytest.mark.parametrize("temperature", [0.3, 0.7, 2.5])
@pytest.mark.parametrize("seed", [None, 8])
def test_temperature_scales_the_distribution(row: torch.Tensor, temperature: float, seed: int | None) -> None:
    torch.manual_seed(7)
    logits = row.unsqueeze(0).expand(DRAWS, -1).contiguous()
    params = [SamplingParams(temperature=temperature, seed=seed)] * DRAWS
    # One seed on every row would repeat one draw: a seeded request varies its count instead.
    tokens = sample_batch(logits, params, list(range(DRAWS)))
    expected = (row / temperature).softmax(-1)
    assert _chi_square(tokens, expected) < _chi2_critical(int((expected > 1e-4).sum()) - 1)
    # The same draws must be inconsistent with the untempered distribution.
    assert _chi_square(tokens, row.softmax(-1)) > 10 * CHI2_CRITICAL_DF7


def test_top_p_renormalises_over_the_nucleus(row: torch.Tensor) -> None:
    torch.manual_seed(8)
    probs = row.softmax(-1)  # sorted descending already
    nucleus = int((probs.cumsum(0) - probs < 0.8).sum())
    expected = torch.zeros_like(probs)
    expected[:nucleus] = probs[:nucleus] / probs[:nucleus].sum()
    tokens = _draws(row, SamplingParams(top_p=0.8))
    assert _chi_square(tokens, expected) < _chi2_critical(nucleus - 1)


def test_extreme_temperatures_never_give_nan() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(9)) * 50
    logits[:, :10] = float("-inf")
    tiny = [SamplingParams(temperature=1e-30, top_p=0.9), SamplingParams(temperature=1e-45)] * 2
    out = sample_batch(logits, tiny, [0] * 4)
    assert torch.equal(out, logits.argmax(dim=-1))
    huge = [SamplingParams(temperature=1e30, min_p=0.5, top_k=50), SamplingParams(temperature=1e38)]
    out = sample_batch(logits[:2], huge, [0, 0])
    assert ((out >= 10) & (out < 1000)).all()


def test_huge_temperature_is_near_uniform() -> None:
    torch.manual_seed(10)
    row = torch.tensor([5.0, 3.0, 0.0, -2.0, -4.0, 1.0, 2.0, -1.0])
    tokens = _draws(row, SamplingParams(temperature=1e6))
    assert _chi_square(tokens, torch.full((VOCAB,), 1 / VOCAB)) < CHI2_CRITICAL_DF7


def test_masked_logits_are_never_sampled() -> None:
    logits = torch.zeros(1000, 16)
    logits[:, ::2] = float("-inf")
    torch.manual_seed(11)
    out = sample_batch(logits, [SamplingParams(temperature=5.0)] * 1000, [0] * 1000)
    assert (out % 2 == 1).all()


def test_low_precision_logits() -> None:
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(top_k=4)]
    out = sample_batch(logits, params, [0, 0, 0])
    assert out.shape == (3,) and out.dtype == torch.int64
    assert int(out[0]) == int(logits[0].argmax())


def test_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, 4), [SamplingParams()], [0, 0])


def test_top_k_zero_means_no_top_k(row: torch.Tensor) -> None:
    logits = row.unsqueeze(0).expand(DRAWS, -1).contiguous()
    params = [SamplingParams(top_k=0, top_p=0.999, seed=s) for s in range(DRAWS)]
    tokens = sample_batch(logits, params, [0] * DRAWS)
    assert _chi_square(tokens, row.softmax(-1)) < CHI2_CRITICAL_DF7
