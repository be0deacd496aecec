"""`native.paged_prefill_attention`: a prefill chunk attending causally to its sequence through its pages, against
a float64 reference, for the shapes models give it (grouped query heads, head sizes on and off its 32-dim
passes, sliding windows, soft-capped scores, attention sinks, one-token pages), reading strided rows and
writing into a view; and the same bits from an AVX2 build as from this CPU's."""

from __future__ import annotations

import pytest
import torch

from batchserve.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the C kernels")


def _pool(prefix: int, length: int, heads: int, kv_heads: int, dim: int, page_size: int, seed: int = 0):
    """Scattered pages of a random pool holding the sequence, and the chunk's queries."""
    torch.manual_seed(seed)
    used = -(-(prefix + length) // page_size)
    k_pool, v_pool = torch.randn(2, used + 7, page_size, kv_heads, dim).unbind(0)
    pages = (torch.randperm(used + 6)[:used] + 1).to(torch.int64)
    return torch.randn(length, heads, dim), k_pool.contiguous(), v_pool.contiguous(), pages


def _reference(q, k_pool, v_pool, pages, prefix, window=0, softcap=0.0, sinks=None):
    length, heads, dim = q.shape
    kv_heads, total = k_pool.shape[2], prefix + length
    keys = k_pool[pages].reshape(-1, kv_heads, dim)[:total].repeat_interleave(heads // kv_heads, dim=1).double()
    values = v_pool[pages].reshape(-1, kv_heads, dim)[:total].repeat_interleave(heads // kv_heads, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * dim**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query, key = torch.arange(prefix, total)[:, None], torch.arange(total)[None, :]
    allowed = (key <= query) & ((key > query - window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[:, None, None].expand(heads, length, 1)), dim=-1)
    probs = scores.softmax(-1)[..., :total]
    return torch.einsum("hqk,khd->qhd", probs, values).float()


CASES = {  # prefix, length, heads, kv_heads, head_dim, page_size, window, softcap, sinks
    "fresh prompt": (0, 70, 9, 3, 64, 16, 0, 0.0, False),
    "after a prefix": (146, 133, 9, 3, 64, 16, 0, 0.0, False),
    "one row": (40, 1, 4, 2, 64, 16, 0, 0.0, False),
    "one-token pages": (9, 30, 4, 1, 32, 1, 0, 0.0, False),
    "small heads": (3, 30, 4, 2, 16, 3, 0, 0.0, False),
    "off the 32-dim passes": (20, 37, 6, 3, 80, 16, 0, 0.0, False),
    "wide heads, big group": (50, 45, 16, 2, 128, 16, 0, 0.0, False),
    "window from the prefix": (300, 37, 8, 4, 64, 16, 50, 0.0, False),
    "window inside the chunk": (0, 70, 4, 4, 32, 16, 17, 0.0, False),
    "soft-capped, sinks": (10, 60, 8, 2, 64, 4, 0, 30.0, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_chunk_matches_the_reference(case: str) -> None:
    prefix, length, heads, kv_heads, dim, page_size, window, softcap, sink = CASES[case]
    q, k_pool, v_pool, pages = _pool(prefix, length, heads, kv_heads, dim, page_size)
    sinks = torch.randn(heads) if sink else None
    out = native.paged_prefill_attention(
        q, k_pool, v_pool, pages, prefix, dim**-0.5, window=window, softcap=softcap, sinks=sinks
    )
    expected = _reference(q, k_pool, v_pool, pages, prefix, window, softcap, sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_strided_rows_in_and_out() -> None:
    """The layers hand it q inside the step's rotated q|k rows and let it write its rows of the step's output."""
    q, k_pool, v_pool, pages = _pool(17, 25, 4, 2, 32, 16)
    wide_q = torch.randn(25, 4 + 2, 32)
    wide_q[:, :4] = q
    out = torch.zeros(30, 4, 32)
    native.paged_prefill_attention(wide_q[:, :4], k_pool, v_pool, pages, 17, 32**-0.5, out=out[3:28])
    assert torch.equal(out[3:28], native.paged_prefill_attention(q, k_pool, v_pool, pages, 17, 32**-0.5))
    assert not out[:3].any() and not out[28:].any()


def test_a_chunk_past_its_pages_is_refused() -> None:
    q, k_pool, v_pool, pages = _pool(10, 20, 4, 2, 32, 16)
    with pytest.raises(ValueError, match="runs past its pages"):
        native.paged_prefill_attention(q, k_pool, v_pool, pages[:1], 10, 1.0)


@pytest.mark.skipif(not native.has_wide_vectors(), reason="this CPU builds the AVX2 path already")
def test_an_avx2_build_gives_this_cpus_bits(tmp_path) -> None:
    """AVX-512 blocks score 16 keys a vector and 24 queries a block, AVX2 ones 8 and 12; each output is the same
    FMA chains either way, so a checkpoint gives the same tokens on both machines."""
    narrow_flags = [flag.replace("-march=native", "-march=x86-64-v3") for flag in native.BASE_FLAGS]
    native._build(native.compiler(), [*narrow_flags, "-fopenmp"], tmp_path / "avx2.so")
    avx2 = native._load(tmp_path / "avx2.so")
    for case in CASES:
        prefix, length, heads, kv_heads, dim, page_size, window, softcap, sink = CASES[case]
        q, k_pool, v_pool, pages = _pool(prefix, length, heads, kv_heads, dim, page_size, seed=4)
        sinks = torch.randn(heads) if sink else None
        wide = native.paged_prefill_attention(
            q, k_pool, v_pool, pages, prefix, dim**-0.5, window=window, softcap=softcap, sinks=sinks
        )
        narrow = torch.empty_like(wide)
        assert (
            avx2.paged_prefill_attention(
                q.data_ptr(),
                q.stride(0),
                k_pool.data_ptr(),
                v_pool.data_ptr(),
                pages.data_ptr(),
                prefix,
                length,
                narrow.data_ptr(),
                narrow.stride(0),
                heads,
                kv_heads,
                dim,
                page_size,
                dim**-0.5,
                window,
                softcap,
                None if sinks is None else sinks.data_ptr(),
            )
            == 0
        )
        assert torch.equal(wide, narrow), case
