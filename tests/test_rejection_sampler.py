"""Speculative sampling (`kernels.sampling.rejection_sample`) reproduces the target distribution.

Many draws over a small vocabulary: a draft token from q, the rejection step against p, and the
empirical distribution of the result compared with p by KL divergence, beside plain sampling from p
with as many draws (TensorRT-LLM's test of its rejection sampler does the same). With N draws over V
tokens an unbiased sampler's KL is about (V - 1) / (2 N); a biased one's stays at its bias."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchserve.kernels.sampling import draft_sample, filtered_scores, rejection_sample, sample_batch
from batchserve.shared.messages import SamplingParams
from batchserve.shared.verification import accepted_lengths

VOCAB = 8
DRAWS = 200_000


def kl(counts: torch.Tensor, p: torch.Tensor) -> float:
    empirical = counts.double() / counts.sum()
    mask = empirical > 0
    return float((empirical[mask] * (empirical[mask] / p.double()[mask]).log()).sum())


def log_exponential(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).exponential_(generator=generator).clamp_min_(1e-30).log_()


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a draft q that disagree (q puts mass where p has none, and the reverse)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(VOCAB, generator=g) ** 2
    q = torch.rand(VOCAB, generator=g) ** 2
    p[0], q[1] = 0.0, 0.0
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_is_distributed_as_the_target(seed):
    p, q = distributions(seed)
    g = torch.Generator().manual_seed(100 + seed)
    proposed = torch.multinomial(q, DRAWS, replacement=True, generator=g)
    uniform = torch.rand(DRAWS, generator=g)
    tokens = rejection_sample(
        p.expand(DRAWS, VOCAB), q.expand(DRAWS, VOCAB), proposed, uniform, log_exponential((DRAWS, VOCAB), g)
    )
    plain = torch.multinomial(p, DRAWS, replacement=True, generator=g)
    spec_kl = kl(torch.bincount(tokens, minlength=VOCAB), p)
    plain_kl = kl(torch.bincount(plain, minlength=VOCAB), p)
    expected = (VOCAB - 1) / (2 * DRAWS)
    assert spec_kl < 4 * expected and spec_kl < 3 * plain_kl + expected, (spec_kl, plain_kl)
    assert int((tokens == 0).sum()) == 0  # p has no mass there: never output, though q proposes it
    # a rejected position never outputs its proposal (verification's rule relies on it)
    accepted = tokens == proposed
    assert accepted.float().mean().item() == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.01)


def test_a_row_of_positions_keeps_each_accepted_token_distributed_as_its_target():
    """Two positions, as a row [last token, d1, d2] verifies them: the first output token is
    distributed as p1; where d1 was accepted the second is distributed as p2 (drawn by rejection
    against d2, or, with nothing proposed after the row's last position, from p alone)."""
    p1, q1 = distributions(3)
    p2, q2 = distributions(4)
    p3, _ = distributions(5)
    g = torch.Generator().manual_seed(7)
    d1 = torch.multinomial(q1, DRAWS, replacement=True, generator=g)
    d2 = torch.multinomial(q2, DRAWS, replacement=True, generator=g)
    # packed positions: row r's are 3r, 3r + 1, 3r + 2 (its last position proposes nothing)
    target = torch.stack([p1, p2, p3]).repeat(DRAWS, 1)
    draft = torch.stack([q1, q2, torch.zeros(VOCAB)]).repeat(DRAWS, 1)
    proposed = torch.stack([d1, d2, torch.full((DRAWS,), -1)], dim=1).reshape(-1)
    tokens = rejection_sample(
        target, draft, proposed, torch.rand(3 * DRAWS, generator=g), log_exponential((3 * DRAWS, VOCAB), g)
    )
    fed = torch.stack([torch.zeros(DRAWS, dtype=torch.long), d1, d2], dim=1).reshape(-1)
    firsts = np.arange(DRAWS, dtype=np.int64) * 3
    kept = accepted_lengths(tokens.numpy(), fed.numpy(), firsts, np.full(DRAWS, 3, dtype=np.int64))
    rows = tokens.view(DRAWS, 3)
    first = rows[:, 0]
    assert kl(torch.bincount(first, minlength=VOCAB), p1) < 4 * (VOCAB - 1) / (2 * DRAWS)
    second = rows[torch.from_numpy(kept >= 2), 1]
    assert second.shape[0] > DRAWS // 10  # d1 accepted about min(p1, q1).sum() = 20% of the time
    assert kl(torch.bincount(second, minlength=VOCAB), p2) < 4 * (VOCAB - 1) / (2 * second.shape[0])
    third = rows[torch.from_numpy(kept == 3), 2]
    assert third.shape[0] > DRAWS // 50
    assert kl(torch.bincount(third, minlength=VOCAB), p3) < 4 * (VOCAB - 1) / (2 * third.shape[0])


def test_a_draft_equal_to_the_target_is_always_accepted():
    p, _ = distributions(6)
    g = torch.Generator().manual_seed(8)
    proposed = torch.multinomial(p, 1000, replacement=True, generator=g)
    tokens = rejection_sample(
        p.expand(1000, VOCAB),
        p.expand(1000, VOCAB),
        proposed,
        torch.rand(1000, generator=g),
        log_exponential((1000, VOCAB), g),
    )
    assert torch.equal(tokens, proposed)


def test_seeded_draws_depend_on_seed_and_count_only():
    """A seeded draft draws with the noise the model samples the same position with (so a draft whose
    distribution is the model's proposes exactly the model's token), the same in any batch; it is then
    verified by an exact match, never by rejection."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=0.8, seed=6),
        SamplingParams(temperature=0.0),
    ]
    tokens, probs = draft_sample(logits, params, [4, 4, 4])
    again, _ = draft_sample(logits[:2].flip(0), params[:2][::-1], [4, 4])
    assert tokens[:2].tolist() == again.flip(0).tolist()
    assert tokens.tolist() == sample_batch(logits, params, [4, 4, 4]).tolist()  # coupled with the model's draw
    assert int(tokens[2]) == int(logits[2].argmax())
    assert torch.allclose(probs[0], filtered_scores(logits[:1], params[:1]).softmax(-1)[0])
