"""The C kernels (`kernels.native`): paged decode attention against a plain softmax reference over
many shapes (the specialised and the generic paths), its input checks, and the fallback when the
kernels are disabled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from native_marks import requires_native_kernels

from batchserve.kernels import native, ops
from batchserve.kernels.attention import create_backend, resolve_backend_name
from batchserve.kernels.kv_cache import KVCache

pytestmark = requires_native_kernels


def _reference(q, k_pool, v_pool, pages, lens, scale, sinks=None, window=0):
    """With `sinks` [heads]: each head's sink logit joins its softmax (a last column, dropped after); with
    `window`, a row attends to its last `window` tokens."""
    page_size = k_pool.shape[1]
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[2]
    for row, length in enumerate(lens.tolist()):
        first = max(0, length - window) if window else 0
        tokens = [int(pages[row, t // page_size]) * page_size + t % page_size for t in range(first, length)]
        keys = k_pool.flatten(0, 1)[tokens].repeat_interleave(group, dim=1)  # [len, heads, dim]
        values = v_pool.flatten(0, 1)[tokens].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[row].double(), keys.double()) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None]), dim=1)
        probs = scores.softmax(-1)[:, : len(tokens)]
        out[row] = torch.einsum("ht,thd->hd", probs, values.double()).float()
    return out


def _case(heads, kv_heads, head_dim, page_size, lens, *, q_spread=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_pages = -(-max(lens) // page_size) + 1  # one spare column: pages past a row's length are ignored
    num_pages = len(lens) * max_pages + 1
    k_pool = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    pages = (torch.randperm(num_pages - 1, generator=gen)[: len(lens) * max_pages] + 1).view(len(lens), max_pages)
    # q as a strided view, the way the model hands it over (q and k heads share one projection row)
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen) * q_spread
    return qk[:, :heads], k_pool, v_pool, pages.contiguous(), torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [
        (9, 3, 64),  # the default model: specialised path
        (8, 1, 128),  # group 8, head_dim 128: specialised
        (4, 4, 64),  # no GQA
        (12, 1, 64),  # group 12: generic path
        (6, 2, 12),  # head_dim not a multiple of 8: generic path
        (4, 2, 16),  # head_dim 16: generic path
    ],
)
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_decode_attention_matches_softmax_reference(heads, kv_heads, head_dim, page_size):
    lens = [1, 2, 7, 8, 9, 16, 17, 40, 3]
    q, k_pool, v_pool, pages, lens_t = _case(heads, kv_heads, head_dim, page_size, lens)
    scale = head_dim**-0.5
    out = native.paged_decode_attention(q, k_pool, v_pool, pages, lens_t, scale)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, pages, lens_t, scale), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16)])
def test_attention_sinks_join_each_heads_softmax(heads, kv_heads, head_dim):
    """gpt-oss's sinks, per query head (specialised and generic paths), in a window too: the keys' weights
    are what a softmax over them and the sink gives them."""
    lens = [1, 9, 40, 3]
    q, k_pool, v_pool, pages, lens_t = _case(heads, kv_heads, head_dim, 4, lens, seed=3)
    sinks = torch.linspace(-2.0, 4.0, heads)
    out = native.paged_decode_attention(q, k_pool, v_pool, pages, lens_t, 0.3, sinks=sinks)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, pages, lens_t, 0.3, sinks), atol=2e-6, rtol=2e-5)
    assert not torch.allclose(out, native.paged_decode_attention(q, k_pool, v_pool, pages, lens_t, 0.3))
    windowed = native.paged_decode_attention(q, k_pool, v_pool, pages, lens_t, 0.3, window=5, sinks=sinks)
    torch.testing.assert_close(
        windowed, _reference(q, k_pool, v_pool, pages, lens_t, 0.3, sinks, window=5), atol=2e-6, rtol=2e-5
    )
    with pytest.raises(ValueError, match="sinks must be"):
        native.paged_decode_attention(q, k_pool, v_pool, pages, lens_t, 0.3, sinks=sinks[:-1])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_each_row_attends_as_it_would_alone(heads, kv_heads):
    """Threads take (row, kv head) pairs, so which thread computes a row's heads depends on the batch
    (alone, a row's heads are split over both); its output is the same bits either way."""
    lens = [300, 1, 77, 16, 129]
    q, k_pool, v_pool, pages, lens_t = _case(heads, kv_heads, 64, 16, lens, seed=2)
    batched = native.paged_decode_attention(q, k_pool, v_pool, pages, lens_t, 0.125)
    for row in range(len(lens)):
        alone = native.paged_decode_attention(
            q[row : row + 1], k_pool, v_pool, pages[row : row + 1].contiguous(), lens_t[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], batched[row])


def test_peaked_and_flat_softmax_stay_accurate():
    """Scores spread over hundreds (many exp terms underflow) and all-equal keys (uniform weights)."""
    q, k_pool, v_pool, pages, lens = _case(9, 3, 64, 16, [33, 64, 5], q_spread=30.0, seed=1)
    out = native.paged_decode_attention(q, k_pool, v_pool, pages, lens, 1.0)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, pages, lens, 1.0), atol=1e-5, rtol=1e-4)
    k_pool.zero_()
    out = native.paged_decode_attention(q, k_pool, v_pool, pages, lens, 1.0)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, pages, lens, 1.0), atol=2e-6, rtol=2e-5)


def test_bad_inputs_are_clear_errors_not_crashes():
    q, k_pool, v_pool, pages, lens = _case(4, 2, 64, 4, [3, 5])

    def call(**kw):
        return native.paged_decode_attention(
            **{**dict(q=q, k_pool=k_pool, v_pool=v_pool, pages=pages, lens=lens, scale=0.1), **kw}
        )

    with pytest.raises(ValueError, match="outside the pool"):
        call(pages=torch.full_like(pages, k_pool.shape[0]))
    with pytest.raises(ValueError, match="lens out of"):
        call(lens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="lens out of"):
        call(lens=torch.tensor([3, pages.shape[1] * 4 + 1]))
    with pytest.raises(ValueError, match="float32"):
        call(q=q.double())
    with pytest.raises(ValueError, match="int64"):
        call(pages=pages.int())
    with pytest.raises(ValueError, match="shapes disagree"):
        call(q=torch.randn(2, 3, 64))
    assert call(q=q[:0], lens=lens[:0], pages=pages[:0]).shape == (0, 4, 64)


def test_disabled_kernels_fall_back_to_the_torch_backend(monkeypatch):
    cache = KVCache(
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        num_pages=8,
        max_running_requests=2,
        max_pages_per_request=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.library.cache_clear()
    try:
        assert not native.available()
        assert resolve_backend_name("auto", "cpu", torch.float32) == "torch"
        with pytest.raises(native.NativeKernelError, match="could not be built"):
            create_backend("cpu", cache, 4, 2, 16, 0.25)
        with pytest.raises(native.NativeKernelError, match="not available"):
            native.paged_decode_attention(
                torch.randn(1, 4, 16),
                cache.k[0],
                cache.v[0],
                torch.ones(1, 1, dtype=torch.int64),
                torch.ones(1, dtype=torch.int64),
                0.25,
            )
    finally:
        monkeypatch.delenv(native.DISABLE_ENV)
        native.library.cache_clear()
    assert native.available()


def test_cpu_backend_refuses_other_dtypes():
    cache = KVCache(
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        num_pages=8,
        max_running_requests=2,
        max_pages_per_request=4,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="float32 on the CPU"):
        create_backend("cpu", cache, 4, 2, 16, 0.25)


@pytest.mark.parametrize("n", [1, 7, 8, 63, 64, 65, 200, 49152])
def test_argmax_rows_gives_torchs_answer(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n + 3, generator=gen)[:, 1 : n + 1]  # strided rows
    x[1] = 0.0  # all tied: the first index
    x[2, n // 2] = float("nan")  # a NaN wins (torch ranks it above every number) ...
    x[3, -1] = float("nan")
    x[3, n // 3] = float("nan")  # ... the first NaN of the row
    x[4] = float("-inf")
    x[5, n // 2 :] = 10.0  # ties at the max: the first of them
    x[6, 0] = float("inf")
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))


def test_a_compiler_that_fails_leaves_the_torch_forms_in_charge(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is None
        assert "could not build the C kernels" in caplog.text
        assert not list((tmp_path / "kernels").glob("*"))  # no half-written library left behind
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.available()


def test_shapes_outside_the_kernels_reach_are_refused_or_take_the_generic_path():
    # group 1 x head_dim 1064 once collided with the specialised (group 2, head_dim 64) case
    q, k_pool, v_pool, pages, lens = _case(1, 1, 1064, 4, [3, 6])
    out = native.paged_decode_attention(q, k_pool, v_pool, pages, lens, 0.03)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, pages, lens, 0.03), atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="shapes disagree"):  # no heads
        native.paged_decode_attention(torch.empty(1, 0, 1064), k_pool, v_pool, pages[:1], lens[:1], 0.03)
    with pytest.raises(ValueError, match="shapes disagree"):  # no kv heads
        empty_pool = torch.empty(k_pool.shape[0], 4, 0, 1064)
        native.paged_decode_attention(q, empty_pool, empty_pool, pages, lens, 0.03)
    with pytest.raises(ValueError, match="out of range"):  # max_pages * page_size would wrap in C's int64
        native.check_pages(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([100000]), 1, 2**62 + 1)


def test_silu_below_the_exp_range_matches_torch():
    gate_up = torch.zeros(2, 32)
    gate_up[0, :16] = torch.tensor([-1e38, -1e30, -89.0, -88.7, -88.5, -87.9, float("-inf"), -0.0] * 2)
    gate_up[1, :16] = torch.linspace(-100, 100, 16)
    gate_up[:, 16:] = 3.0
    torch.testing.assert_close(
        native.silu_and_mul(gate_up), ops.silu_and_mul_torch(gate_up), equal_nan=True, rtol=3e-7, atol=0.0
    )


def test_add_rms_norm_refuses_overlapping_inputs():
    buffer = torch.randn(5, 8)
    with pytest.raises(ValueError, match="overlap"):
        native.add_rms_norm(buffer[1:], buffer[:-1], torch.ones(8), 1e-6)


def test_a_corrupt_cached_library_is_rebuilt_and_readable_by_others(monkeypatch, tmp_path):
    name = Path(native.library()._name).name  # the session's build: the name a build here gets too
    # a fresh cache holding an empty file under that name (what a crash mid-write could leave); one build
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / name).write_bytes(b"")
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        rebuilt = tmp_path / "kernels" / name
        assert rebuilt.stat().st_size > 0
        assert rebuilt.stat().st_mode & 0o777 == 0o755  # a service account can load what root built
        monkeypatch.setenv(native.DISABLE_ENV, "off")
        assert native.disabled()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
