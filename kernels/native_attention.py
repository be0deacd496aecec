"""The paged-attention C kernels' Python forms (`kernels/csrc/`): attention of decode rows and of prefill
chunks through their requests' page lists, the write of a step's new keys and values into the KV pool,
and the bounds those kernels trust (`check_pages`, `check_locs`), which an attention backend checks once
per step rather than once per layer. `kernels.native` re-exports them beside the other kernels.
"""

from __future__ import annotations

import torch

from batchserve.kernels.native_build import loaded_library
from batchserve.kernels.native_checks import check, check_rows


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    locs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    locs_checked: bool = False,
) -> None:
    """k_pool.flatten(0, 1)[locs] = k (and v alike): pools [pages, page_size, kv_heads, head_dim], k/v
    [tokens, kv_heads, head_dim] (rows may be strided), locs [tokens] int64 flat token slots.
    `locs_checked`: the caller ran `check_locs` on these locs already."""
    check(k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape == v_pool.shape, "pools must match")
    check(k.shape == v.shape == (locs.shape[0], *k_pool.shape[2:]), "k/v must be [tokens, kv_heads, head_dim]")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k", k), ("v", v)):
        check_rows(t, name)
    if not locs_checked:
        check_locs(locs, k_pool.shape[0] * k_pool.shape[1])
    loaded_library().write_kv(
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        k_pool.shape[2] * k_pool.shape[3],
        locs.data_ptr(),
        locs.shape[0],
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
    )


def check_locs(locs: torch.Tensor, num_slots: int) -> None:
    """The bound `write_kv` trusts: every loc is a token slot of the pool."""
    check(
        locs.dtype == torch.int64 and locs.dim() == 1 and locs.is_contiguous() and locs.is_cpu,
        "locs must be a contiguous int64 CPU vector",
    )
    if locs.numel():
        check(int(locs.min()) >= 0 and int(locs.max()) < num_slots, "a KV location is outside the pool")


MAX_CONTEXT = 2**31 - 1  # max_pages * page_size: the C code sizes scratch buffers with it


def _check_page_layout(pages: torch.Tensor, lens: torch.Tensor, page_size: int) -> None:
    check(
        pages.dtype == lens.dtype == torch.int64
        and pages.is_contiguous()
        and lens.is_contiguous()
        and pages.dim() == 2
        and lens.shape == pages.shape[:1]
        and pages.is_cpu
        and lens.is_cpu,
        "pages [b, max_pages] and lens [b] must be contiguous int64 CPU tensors",
    )
    check(page_size >= 1 and pages.shape[1] * page_size <= MAX_CONTEXT, "max_pages * page_size out of range")


def check_pages(pages: torch.Tensor, lens: torch.Tensor, num_pages: int, page_size: int) -> None:
    """The bounds the C code trusts: every page inside the pool, 1 <= lens <= max_pages * page_size."""
    _check_page_layout(pages, lens, page_size)
    if lens.numel():
        check(
            int(lens.min()) >= 1 and int(lens.max()) <= pages.shape[1] * page_size,
            "lens out of [1, max_pages * page_size]",
        )
        check(int(pages.min()) >= 0 and int(pages.max()) < num_pages, "a page index is outside the pool")


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    pages_checked: bool = False,
) -> torch.Tensor:
    """Attention of one query token per row over its cached tokens, read through its page list.

    q [b, heads, head_dim] (rows may be strided, heads and dims contiguous), k_pool/v_pool
    [num_pages, page_size, kv_heads, head_dim], pages [b, max_pages] int64, lens [b] int64 with
    1 <= lens <= max_pages * page_size; all fp32 on the CPU. Returns [b, heads, head_dim]. `window` > 0:
    each row attends to its last `window` tokens only (a sliding-window layer); `softcap` > 0: scores are
    soft-capped before the softmax; `sinks` [heads] fp32: each head's sink logit joins its softmax's
    denominator (gpt-oss).
    `pages_checked`: the caller ran `check_pages` on these pages and lens already (once per step
    rather than once per layer), so only their scan for out-of-range values is skipped.
    """
    lib = loaded_library()
    batch, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pool.shape
    _check_attention(q, k_pool, v_pool, window, sinks)
    if pages_checked:
        _check_page_layout(pages, lens, page_size)
    else:
        check_pages(pages, lens, num_pages, page_size)
    if lens.shape[0] != batch:
        raise ValueError(f"{batch} query rows but {lens.shape[0]} lens")
    if batch == 0:
        return q.new_empty(q.shape)
    max_pages = pages.shape[1]
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32)
    status = lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        pages.data_ptr(),
        max_pages,
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory")
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pages: torch.Tensor,
    prefix: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk of one sequence: q [length, heads, head_dim] (rows may be strided) at positions prefix .. prefix +
    length - 1 attends causally to the sequence's tokens through its pages [max_pages] int64 (the chunk's own
    keys and values written to the pool already; every page checked by the caller); window, softcap and sinks
    as in `paged_decode_attention`. Into `out` (a fresh tensor when None): [length, heads, head_dim], rows may be
    strided."""
    length, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    _check_attention(q, k_pool, v_pool, window, sinks)
    check(
        pages.dim() == 1 and pages.is_contiguous() and pages.dtype == torch.int64 and pages.is_cpu,
        "pages must be [max_pages] int64 on the CPU",
    )
    check(0 <= prefix and prefix + length <= pages.shape[0] * page_size, "the chunk runs past its pages")
    if out is None:
        out = torch.empty((length, heads, head_dim), dtype=torch.float32)
    check(out.shape == q.shape and out.stride(2) == 1 and out.stride(1) == head_dim, "out must be shaped as q")
    status = loaded_library().paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        pages.data_ptr(),
        prefix,
        length,
        out.data_ptr(),
        out.stride(0),
        heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_prefill_attention could not allocate its scratch memory")
    return out


def _check_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, window: int, sinks: torch.Tensor | None
) -> None:
    """What both attention kernels need of q, the pools and the sinks (each checks its pages its own way)."""
    _, heads, head_dim = q.shape
    _, _, kv_heads, pool_head_dim = k_pool.shape
    check(q.dtype is k_pool.dtype is v_pool.dtype is torch.float32, "q, k_pool and v_pool must be float32")
    check(q.is_cpu and k_pool.is_cpu and v_pool.is_cpu, "tensors must be on the CPU")
    if (
        min(heads, kv_heads, head_dim) < 1
        or pool_head_dim != head_dim
        or heads % kv_heads
        or v_pool.shape != k_pool.shape
    ):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
        )
    check(q.stride(2) == 1 and q.stride(1) == head_dim, "q's heads and dims must be contiguous")
    check(k_pool.is_contiguous() and v_pool.is_contiguous(), "the pools must be contiguous")
    check(window >= 0, "window must be >= 0")
    check(
        sinks is None
        or (sinks.shape == (heads,) and sinks.dtype == torch.float32 and sinks.is_cpu and sinks.is_contiguous()),
        f"sinks must be contiguous fp32 [{heads}] on the CPU",
    )
