"""Batched next-token sampling: greedy, temperature, top-k, top-p, min-p and per-request seeds;
the logits adjustments that come before it (penalties, bias, bans) and logprobs.

Everything runs as whole-batch tensor ops; the only Python work per request is reading its
`SamplingParams` into a few small parameter tensors. Filters apply in vLLM's order: temperature,
then top-k, top-p, min-p (min-p relative to the most likely token).

Sampling is an exponential race (Gumbel-max): the token is `argmax(logit / T - log(E))` with
`E ~ Exp(1)` per token, which picks token `i` with probability `softmax(logit / T)[i]` without a
normalisation or a cumulative sum. Unseeded rows draw `E` from the global torch RNG. Seeded rows
derive `E` from a counter-based hash of `(seed, sample_count, token_id)`, so a seeded request gets
the same tokens whatever else is in its batch, whatever its row and on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchserve.kernels import native
from batchserve.shared.messages import SamplingParams, TokenLogprobs

__all__ = [
    "sample_batch",
    "sample_with_scores",
    "draft_sample",
    "filtered_scores",
    "rejection_sample",
    "speculative_noise",
    "apply_repetition_penalty_",
    "token_logprobs",
]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so the int64 hash never
# relies on signed overflow (which could differ between devices).
_MUL_A = 0x7FEB352D
_MUL_B = 0x27D4EB2F
_MUL_C = 0x165667B1


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], sample_counts: Sequence[int]) -> torch.Tensor:
    """Pick one token per row of `logits` ([n, vocab], any float dtype and device).

    `params[i]` and `sample_counts[i]` belong to row i, one row per sampled position:
    `sample_counts[i]` counts the tokens its request sampled before this position (a decode row of k
    positions gives its request k rows, counts c .. c + k - 1). Returns [n] int64 token ids on the
    logits' device.
    """
    return _sample(logits, params, sample_counts, keep_scores=False)[0]


def sample_with_scores(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    sample_counts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample_batch`'s tokens, and the `filtered_scores` they were drawn from (None when every row is
    greedy): speculative sampling verifies against their distributions."""
    return _sample(logits, params, sample_counts, keep_scores=True)


def _sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], sample_counts: Sequence[int], keep_scores: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens, and with `keep_scores` the filtered scores (otherwise the noise is subtracted from
    them in place, sparing a copy)."""
    n, vocab = logits.shape
    if n != len(params) or n != len(sample_counts):
        raise ValueError(f"{n} logit rows but {len(params)} params and {len(sample_counts)} counts")
    if all(p.temperature == 0.0 for p in params):
        return _argmax(logits), None
    greedy = [p.temperature == 0.0 for p in params]
    scores = filtered_scores(logits, params)
    noise = _log_exponential_noise(params, sample_counts, greedy, vocab, logits.device)
    sampled = _argmax(scores - noise if keep_scores else scores.sub_(noise))
    if any(greedy):
        greedy_mask = torch.tensor(greedy, dtype=torch.bool).to(logits.device, non_blocking=True)
        sampled = torch.where(greedy_mask, _argmax(logits), sampled)
    return sampled, scores if keep_scores else None


def filtered_scores(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[n, vocab] float32 log-probabilities up to a constant per row: what `sample_batch` samples
    from, `softmax` of which is the sampled distribution (temperature, then top-k, top-p and min-p
    applied; filtered tokens -inf). A greedy row (temperature 0) is returned unscaled and unfiltered:
    its distribution is its argmax alone, which callers take from the logits."""
    n, vocab = logits.shape
    device = logits.device
    greedy = [p.temperature == 0.0 for p in params]
    # One host->device copy for all float parameters: temperature, top_p, min_p, top_k.
    table = torch.tensor(
        [
            (
                1.0 if g else p.temperature,
                p.top_p,
                min(p.min_p, 1.0),  # above 1 would filter out every token
                float(p.top_k if 0 < p.top_k < vocab else vocab),  # 0 or -1: no top-k
            )
            for p, g in zip(params, greedy)
        ],
        dtype=torch.float32,
    ).to(device, non_blocking=True)
    temperature, top_p, min_p, top_k = table.unbind(dim=1)

    # Shift so each row's max is 0 before dividing: extreme temperatures then give finite values
    # or -inf (never inf - inf = NaN), and the min-p threshold becomes a constant log(min_p).
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature.unsqueeze(1)

    # Greedy rows are answered by argmax, so they skip the filters.
    topk_rows = [i for i, p in enumerate(params) if not greedy[i] and 0 < p.top_k < vocab and p.top_p >= 1.0]
    sort_rows = [i for i, p in enumerate(params) if not greedy[i] and p.top_p < 1.0]
    if topk_rows:
        max_k = max(params[i].top_k for i in topk_rows)
        _apply_top_k_rows(scores, topk_rows, top_k, max_k)
    if sort_rows:
        _apply_top_k_top_p_rows(scores, sort_rows, top_k, top_p)
    # min-p: keep p_i >= min_p * p_max, i.e. score_i >= log(min_p) since max score is 0.
    # min_p == 0 gives log(0) = -inf, which filters nothing.
    scores.masked_fill_(scores < torch.log(min_p).unsqueeze(1), float("-inf"))
    return scores


def draft_sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    sample_counts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft model's tokens and the distributions they were drawn from ([n] int64, [n, vocab] float32):
    each row sampled under its request's temperature and filters (`filtered_scores`); greedy rows take
    the argmax. A seeded row draws with the very noise the model will sample that position with (its
    seed and count: `sample_batch`'s), so that where the two distributions are close the two draws
    agree (Gumbel-max coupling); its proposal is then verified by an exact match, which keeps exactly
    the tokens plain decoding samples. Only unseeded sampled rows read their distribution
    (`rejection_sample`)."""
    tokens, scores = sample_with_scores(logits, params, sample_counts)
    if scores is None:
        return tokens, logits.new_zeros((0, logits.shape[1]), dtype=torch.float32)
    return tokens, scores.softmax(dim=-1)


def rejection_sample(
    target: torch.Tensor, draft: torch.Tensor, proposed: torch.Tensor, uniform: torch.Tensor, log_noise: torch.Tensor
) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023), one token per position.

    Position i holds the target's distribution `target[i]` ([m, vocab] probabilities) and the draft
    distribution `draft[i]` that the next fed token `proposed[i]` was drawn from. The proposed token
    is kept with probability min(1, p / q) (kept when `uniform[i]` < p / q); otherwise the token is
    drawn from the residual max(0, p - q), renormalised (by the exponential race with `log_noise[i]`,
    log Exp(1) per token). A position with nothing proposed after it (`proposed[i]` < 0: a row's last)
    draws from p. Either way the token is distributed as p, and a rejected position's token is never
    the proposed one (the residual has no mass there), so verification's rule, keep positions while
    the token sampled before is the one proposed, keeps exactly the accepted ones."""
    rows = torch.arange(target.shape[0], device=target.device)
    has_draft = proposed >= 0
    token = proposed.clamp_min(0)
    p, q = target[rows, token], draft[rows, token]
    accept = has_draft & (uniform * q < p)  # u < p / q without dividing by a zero q
    residual = torch.where(has_draft.unsqueeze(1), (target - draft).clamp_min_(0.0), target)
    # A residual of zero mass cannot be reached (rejection needs p(d) < q(d), so p - q > 0 elsewhere);
    # rounding may still leave one, where p and q are equal but for it: keep the proposal there.
    empty = residual.sum(dim=1) <= 0
    accept |= has_draft & empty
    drawn = _argmax(residual.log() - log_noise)
    return torch.where(accept, proposed, drawn)


def speculative_noise(n: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform [n], log_noise [n, vocab]) for `rejection_sample`, from the global RNG: only unseeded
    rows are verified by rejection (a seeded row's draft is coupled with its own draw and verified by an
    exact match: `draft_sample`)."""
    return torch.rand(n, device=device), _log_torch_exponential(n, vocab, device)


def apply_repetition_penalty_(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    """HF/vLLM repetition penalty in place: a seen token's logit is divided by `penalty` when
    positive, multiplied by it when not. scores [n, vocab] float, seen [n, vocab] bool, penalty [n]."""
    p = penalty.unsqueeze(1)
    penalized = torch.where(scores > 0, scores / p, scores * p)
    torch.where(seen, penalized, scores, out=scores)


def apply_token_bitmask_(scores: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured output: -inf for every token a grammar does not allow, in place.

    scores [n, vocab] float; bitmask [n, ceil(vocab / 32)] int32 on the CPU, bit j of word w set
    when token 32 * w + j is allowed (llguidance's layout). A row left with no finite score (a
    grammar that allows only tokens a logit_bias or min_tokens banned) gets 0 for the allowed ones:
    the grammar wins, since its output must stay valid."""
    n, vocab = scores.shape
    if native.applies_to(scores) and native.rows_contiguous(scores):
        dead = native.apply_token_bitmask(scores, bitmask)
        if not bool(dead.any()):
            return
    banned = _banned_tokens(bitmask.to(scores.device, non_blocking=True), vocab)
    scores.masked_fill_(banned, float("-inf"))
    dead = torch.isneginf(scores.amax(dim=1))
    if bool(dead.any()):
        scores[dead] = torch.where(banned[dead], float("-inf"), 0.0)


def _banned_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab] == 0


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, top: Sequence[int]) -> list[TokenLogprobs]:
    """Row i's logprob of `token_ids[i]` and its `top[i]` most likely tokens.

    logprobs: [n, vocab] log-softmax rows; token_ids: [n] on the same device."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    ids = token_ids.tolist()
    k_max = max(top, default=0)
    if k_max == 0:
        return [TokenLogprobs(t, lp, [], []) for t, lp in zip(ids, chosen)]
    top_values, top_ids = logprobs.topk(k_max, dim=-1)
    values, alternatives = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(t, lp, alt[:k], val[:k]) for t, lp, alt, val, k in zip(ids, chosen, alternatives, values, top)
    ]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1); in C for fp32 on the CPU, where torch's runs on one thread without vectors."""
    if x.dim() == 2 and x.shape[1] and native.applies_to(x) and native.rows_contiguous(x):
        return native.argmax_rows(x)
    return x.argmax(dim=-1)


def _rows_view(scores: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The listed rows of `scores` (the tensor itself when that is every row) and their index."""
    if len(rows) == scores.shape[0]:
        return scores, None
    index = torch.tensor(rows, dtype=torch.long).to(scores.device, non_blocking=True)
    return scores.index_select(0, index), index


def _apply_top_k_rows(scores: torch.Tensor, rows: list[int], top_k: torch.Tensor, max_k: int) -> None:
    """Top-k without a full sort: keep each row's k best tokens (exactly k, ties broken by topk)."""
    sub, index = _rows_view(scores, rows)
    k = top_k if index is None else top_k.index_select(0, index)
    _, best = sub.topk(max_k, dim=-1)
    rank = torch.arange(max_k, device=sub.device).unsqueeze(0)
    keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, best, rank < k.unsqueeze(1))
    sub.masked_fill_(~keep, float("-inf"))
    if index is not None:
        scores.index_copy_(0, index, sub)


def _apply_top_k_top_p_rows(scores: torch.Tensor, rows: list[int], top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-k then top-p on a sorted copy of the listed rows (as vLLM's apply_top_k_top_p)."""
    sub, index = _rows_view(scores, rows)
    k = top_k if index is None else top_k.index_select(0, index)
    p = top_p if index is None else top_p.index_select(0, index)
    vocab = sub.shape[1]
    ascending, order = sub.sort(dim=-1)
    positions = torch.arange(vocab, device=sub.device).unsqueeze(0)
    ascending.masked_fill_(positions < (vocab - k).unsqueeze(1), float("-inf"))
    # Drop the least likely tokens while the mass of everything above them still reaches top_p.
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    ascending.masked_fill_(drop, float("-inf"))
    sub.scatter_(1, order, ascending)
    if index is not None:
        scores.index_copy_(0, index, sub)


def _log_exponential_noise(
    params: Sequence[SamplingParams],
    sample_counts: Sequence[int],
    greedy: Sequence[bool],
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """log(E) with E ~ Exp(1) i.i.d. per [row, token]; seeded rows are a function of their key.
    Greedy rows get global-RNG noise that is never used (cheaper than a hash)."""
    n = len(params)
    seeds = {i: p.seed for i, p in enumerate(params) if p.seed is not None and not greedy[i]}  # row -> seed
    if not seeds:
        return _log_torch_exponential(n, vocab, device)
    keys = torch.tensor([_row_key(seed, sample_counts[i]) for i, seed in seeds.items()], dtype=torch.int64).to(
        device, non_blocking=True
    )
    seeded = _log_hash_exponential(keys, vocab)
    if len(seeds) == n:
        return seeded
    noise = _log_torch_exponential(n, vocab, device)
    index = torch.tensor(list(seeds), dtype=torch.long).to(device, non_blocking=True)
    return noise.index_copy_(0, index, seeded)


def _log_torch_exponential(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    noise = torch.empty(n, vocab, dtype=torch.float32, device=device).exponential_()
    # exponential_ may return exactly 0 on some devices; log(0) = -inf would pick that token.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny).log_()


def _row_key(seed: int, count: int) -> tuple[int, int]:
    """Two 32-bit words from (seed, count) via splitmix64; computed on the host per seeded row."""
    x = (_splitmix64(seed & _MASK64) ^ (count & _MASK64)) & _MASK64
    x = _splitmix64(x)
    return (x & _MASK32, x >> 32)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche permutation on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MUL_A) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MUL_B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * _MUL_C) & _MASK32
    return h ^ (h >> 16)


def _log_hash_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """log(E) for rows keyed by `keys` ([rows, 2] int64 32-bit words), one value per token id."""
    token = torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0)
    bits = _mix32(_mix32(token ^ keys[:, :1]) ^ keys[:, 1:])
    # 23 random bits + 1/2: uniform strictly inside (0, 1) in float32, so E = -log(u) is in (0, 17).
    uniform = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return uniform.log_().neg_().log_()
