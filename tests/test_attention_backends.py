"""The torch attention backend, and the cpu backend (its attention in C), against a naive per-request
reference: mixed prefill chunks (fresh and with a cached prefix) and decodes in one step, pages
scattered, padded rows on the dummy page; in a full layer and in a sliding-window layer; head sizes that
are and are not a multiple of the chunk kernel's 32 dims a pass."""

from __future__ import annotations

import pytest
import torch
from native_marks import requires_native_kernels

from batchserve.kernels.attention import AttentionMetadata, create_backend
from batchserve.kernels.kv_cache import KVCache

HEADS, KV_HEADS = 4, 2


def _naive(q, keys, values, prefix, window=0, softcap=0.0):
    """q [n, H, D] at positions prefix.., keys/values [prefix + n, KVH, D]: causal softmax attention (over
    the last `window` positions only, as transformers masks a sliding window; scores soft-capped)."""
    group = HEADS // KV_HEADS
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * q.shape[-1] ** -0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    n, total = q.shape[0], keys.shape[0]
    query = (prefix + torch.arange(n))[:, None]
    allowed = torch.arange(total)[None, :] <= query
    if window:
        allowed &= torch.arange(total)[None, :] > query - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


# (slot, prefix, extend) of a step's rows:
LAYOUTS = {
    # decode, fresh prefill, short continued chunk (attended as decode rows), decode, 1-token fresh
    # prompt, long continued chunk (SDPA), padded row
    "mixed": [(3, 9, 1), (0, 0, 6), (5, 7, 4), (1, 20, 1), (6, 0, 1), (2, 5, 20), (7, 0, 1)],
    # decode rows with drafts (speculative decoding): the whole step attends as decode rows
    "wide-decode": [(3, 9, 1), (5, 7, 4), (1, 20, 5), (2, 3, 2)],
}


@pytest.mark.parametrize("backend_name", ["torch", pytest.param("cpu", marks=requires_native_kernels)])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (5, 0.0), (5, 0.7)], ids=["full", "window-5", "softcap"])
@pytest.mark.parametrize("dim", [8, 40])
def test_a_step_matches_naive_attention(page_size, backend_name, layout, window, softcap, dim):
    torch.manual_seed(0)
    cache = KVCache(
        num_layers=2,
        num_kv_heads=KV_HEADS,
        head_dim=dim,
        page_size=page_size,
        num_pages=200,
        max_running_requests=8,
        max_pages_per_request=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    backend = create_backend(backend_name, cache, HEADS, KV_HEADS, dim, dim**-0.5, windows=(0, window), softcap=softcap)
    rows = LAYOUTS[layout]
    padded_slot = 7
    free_pages = torch.randperm(199).add(1).tolist()
    history = {}  # slot -> full k, v of its sequence so far (reference)
    kv_locs = []
    layer = 1
    for slot, prefix, extend in rows:
        total = prefix + extend
        if slot == padded_slot:  # padding: its page-table row stays at page 0, it writes the dummy page
            kv_locs.append(0)
            continue
        pages = [free_pages.pop() for _ in range(-(-total // page_size))]
        cache.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        keys, values = torch.randn(total, KV_HEADS, dim), torch.randn(total, KV_HEADS, dim)
        history[slot] = (keys, values)
        locs = [pages[p // page_size] * page_size + p % page_size for p in range(total)]
        cache.k_flat[layer][locs[:prefix]] = keys[:prefix]  # the cached prefix, written by earlier steps
        cache.v_flat[layer][locs[:prefix]] = values[:prefix]
        kv_locs += locs[prefix:]
    num_tokens = sum(e for _, _, e in rows)
    q = torch.randn(num_tokens, HEADS, dim)
    k = torch.cat([history[s][0][p:] if s in history else torch.randn(1, KV_HEADS, dim) for s, p, _ in rows])
    v = torch.cat([history[s][1][p:] if s in history else torch.randn(1, KV_HEADS, dim) for s, p, _ in rows])
    backend.plan(
        AttentionMetadata(
            slots=[r[0] for r in rows],
            prefix_lens=[r[1] for r in rows],
            extend_lens=[r[2] for r in rows],
            kv_locs=torch.tensor(kv_locs),
        )
    )
    # the fused decoder call takes the step whole where the cpu backend attends every row in C
    paged = backend.paged_rows()
    assert (paged is not None) == (backend_name == "cpu")
    if paged is not None:
        _check_chunk_layout(paged, rows, cache)
    out = backend.forward(q, k, v, layer)
    start = 0
    for slot, prefix, extend in rows:
        if slot in history:
            keys, values = history[slot]
            expected = _naive(q[start : start + extend], keys, values, prefix, window, softcap)
            torch.testing.assert_close(out[start : start + extend], expected, atol=1e-5, rtol=1e-5)
        start += extend
    assert torch.isfinite(out).all()


def _check_chunk_layout(paged, rows, cache) -> None:
    """Each chunk's pages in order from its first row on (spilling into its later rows), lens its positions."""
    starts = {}
    start = 0
    for slot, prefix, extend in rows:
        starts[start] = (slot, prefix)
        start += extend
    width = paged.pages.shape[1]
    for first, length in [] if paged.chunks is None else paged.chunks.tolist():
        slot, prefix = starts[first]
        expected = cache.page_table[slot, : -(-(prefix + length) // cache.page_size)].long()
        assert torch.equal(paged.pages.view(-1)[first * width : first * width + len(expected)], expected)
        assert paged.lens[first : first + length].tolist() == list(range(prefix + 1, prefix + length + 1))


def test_unknown_backend_is_a_clear_error():
    cache = KVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        page_size=2,
        num_pages=3,
        max_running_requests=1,
        max_pages_per_request=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_backend("nope", cache, 1, 1, 4, 0.5)
