"""Contract test of the flashinfer attention backend, on the CPU, against flashinfer's documented API.

flashinfer needs CUDA, so the real backend (`kernels/attention/flashinfer.py`) runs here against a fake
`flashinfer` module (injected into `sys.modules`) whose wrappers bind every call against the signatures
of the version pinned in the `gpu` extra, check the documented argument contract, record the calls, and
compute attention in plain torch from what was planned. The torch backend, run on the same batch, is
the reference: the page lists it reads must be the planned ones, and its output must be the fake's.

Checked against flashinfer-python 0.7.4 (PyPI wheel flashinfer_python-0.7.4-py3-none-any.whl,
flashinfer/_build_meta.py: git commit 77039051b0be921788dc2784ec41423b558878ec):
- flashinfer/decode.py, `BatchDecodeWithPagedKVCacheWrapper`:
  `__init__(float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
  paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
  backend="auto", jit_args=None, jit_kwargs=None)`: the workspace "Must be initialized to 0 for its first
  use" and be 16-byte aligned; with `use_cuda_graph` the three buffers must be tensors, the batch size is
  fixed at `len(paged_kv_last_page_len_buffer)`, `len(paged_kv_indptr_buffer)` must be that + 1, and the
  indices buffer must hold the most page indices any plan will give.
  `plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)`;
  optional arguments after `page_size` by keyword only (positional use is deprecated in 0.7.4), the
  keywords being those of `_plan_impl` (`pos_encoding_mode`, `window_left`, `logits_soft_cap`,
  `q_data_type` (default "float16"), `kv_data_type`, `o_data_type`, `data_type` (deprecated alias),
  `sm_scale`, ...). indptr [batch+1], indices [indptr[-1]], last_page_len [batch], all int32. In CUDA-graph
  mode plan() raises unless batch == the fixed size and len(indices) <= len(indices buffer), and copies
  the lists into the construction buffers, which the (captured) kernels read.
  `run(q, paged_kv_cache, *args, q_scale=None, ..., out=None, lse=None, return_lse=False, ...)`:
  q [batch, num_qo_heads, head_dim] of q_data_type; paged_kv_cache a (k, v) tuple of 4-D NHD tensors
  [max_num_pages, page_size, num_kv_heads, head_dim] of kv_data_type; returns [batch, num_qo_heads, head_dim].
- flashinfer/prefill.py, `BatchPrefillWithPagedKVCacheWrapper`: `__init__(float_workspace_buffer,
  kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None, ...)`; `plan(qo_indptr, paged_kv_indptr,
  paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
  head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
  ..., sm_scale=None, ..., q_data_type="float16", kv_data_type=None, ...)`; `run(q, paged_kv_cache, ...)`
  with q [qo_indptr[-1], num_qo_heads, head_dim] and the same output shape. The causal mask is aligned to
  the end of each request's KV: the class docstring's custom-mask example equals `causal=True` with
  `torch.tril(..., diagonal=kv_len - qo_len)`.
- docs/tutorials/kv_layout.rst ("Page Table Layout"; docs.flashinfer.ai/tutorials/kv_layout.html):
  kv_len = page_size * (pages - 1) + last_page_len, 1 <= last_page_len <= page_size; indptr, page indices
  and last_page_len arrays int32; NHD is [.., page_size, num_heads, head_dim].

Without CUDA, the backend's device allocations go through a stand-in for `torch` inside the backend
module (`TorchOnFakeDevice`): tensors asked for on "cuda" are made on the CPU, remembered as device
memory, and `empty` ones are filled with garbage as device memory may be. The KV cache is built on the
CPU and labelled "cuda" for the flashinfer backend only.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import batchserve.kernels.attention.flashinfer as flashinfer_backend_module
from batchserve.kernels.attention import AttentionMetadata, create_backend
from batchserve.kernels.attention.torch_backend import MAX_DECODE_ROW_TOKENS
from batchserve.kernels.kv_cache import KVCache

FLASHINFER_VERSION = "0.7.4"  # the version the signatures below are transcribed from; the gpu extra pins it

PAGE_SIZE = 4
NUM_PAGES = 49  # the dummy page 0 and 8 pages for each of 6 slots
MAX_RUNNING = 6
MAX_PAGES_PER_REQUEST = 8
NUM_LAYERS = 2
HEAD_DIM = 64
SCALE = 0.1  # not flashinfer's default 1 / sqrt(head_dim), so a dropped sm_scale shows
TOLERANCE = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


# -- flashinfer 0.7.4's documented signatures ----------------------------------------------------------
# Transcribed from the wrappers' definitions (see the module docstring); bodies unused, only bound against.


def _decode_init(
    float_workspace_buffer,
    kv_layout="NHD",
    use_cuda_graph=False,
    use_tensor_cores=False,
    paged_kv_indptr_buffer=None,
    paged_kv_indices_buffer=None,
    paged_kv_last_page_len_buffer=None,
    backend="auto",
    jit_args=None,
    jit_kwargs=None,
): ...


# plan() takes `*deprecated_positional_args, **kwargs` after page_size and forwards them to `_plan_impl`,
# whose optional arguments are keyword-only: positional use is deprecated, so the contract is keywords.
def _decode_plan(
    indptr,
    indices,
    last_page_len,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    page_size,
    *,
    pos_encoding_mode="NONE",
    window_left=-1,
    window_right=0,
    logits_soft_cap=None,
    q_data_type="float16",
    kv_data_type=None,
    o_data_type=None,
    data_type=None,
    sm_scale=None,
    rope_scale=None,
    rope_theta=None,
    non_blocking=True,
    block_tables=None,
    seq_lens=None,
    fixed_split_size=None,
    disable_split_kv=False,
    q_len_per_req=1,
    is_causal=None,
    use_token_head_sf=False,
): ...


def _decode_run(
    q,
    paged_kv_cache,
    *args,
    q_scale=None,
    k_scale=None,
    v_scale=None,
    out=None,
    lse=None,
    return_lse=False,
    enable_pdl=None,
    window_left=None,
    sinks=None,
    q_len_per_req=None,
    skip_softmax_threshold_scale_factor=None,
    kv_cache_sf=None,
): ...


def _prefill_init(
    float_workspace_buffer,
    kv_layout="NHD",
    use_cuda_graph=False,
    qo_indptr_buf=None,
    paged_kv_indptr_buf=None,
    paged_kv_indices_buf=None,
    paged_kv_last_page_len_buf=None,
    custom_mask_buf=None,
    mask_indptr_buf=None,
    backend="auto",
    jit_args=None,
    jit_kwargs=None,
    variant_owns_mask=False,
    max_total_num_rows=None,
): ...


def _prefill_plan(
    qo_indptr,
    paged_kv_indptr,
    paged_kv_indices,
    paged_kv_last_page_len,
    num_qo_heads,
    num_kv_heads,
    head_dim_qk,
    page_size,
    head_dim_vo=None,
    custom_mask=None,
    packed_custom_mask=None,
    causal=False,
    pos_encoding_mode="NONE",
    use_fp16_qk_reduction=False,
    sm_scale=None,
    window_left=-1,
    logits_soft_cap=None,
    rope_scale=None,
    rope_theta=None,
    q_data_type="float16",
    kv_data_type=None,
    o_data_type=None,
    non_blocking=True,
    prefix_len_ptr=None,
    token_pos_in_items_ptr=None,
    token_pos_in_items_len=0,
    max_item_len_ptr=None,
    seq_lens=None,
    seq_lens_q=None,
    block_tables=None,
    max_token_per_sequence=None,
    max_sequence_kv=None,
    fixed_split_size=None,
    disable_split_kv=False,
    uniform_q_len=None,
    use_token_head_sf=False,
): ...


def _prefill_run(
    q,
    paged_kv_cache,
    *args,
    q_scale=None,
    k_scale=None,
    v_scale=None,
    out=None,
    lse=None,
    return_lse=False,
    lse_base="log2",
    lse_layout="NH",
    enable_pdl=None,
    window_left=None,
    sinks=None,
    kv_cache_sf=None,
    skip_softmax_threshold_scale_factor=None,
    use_fp16_softmax=None,
    uses_spcompress=None,
): ...


POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


class ContractViolation(AssertionError):
    """A call the documented flashinfer API does not allow."""


def require(condition: Any, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def bind(signature_of: Callable, what: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (defaults applied); an unknown keyword or a missing argument fails."""
    try:
        bound = inspect.signature(signature_of).bind(*args, **kwargs)
    except TypeError as exc:
        raise ContractViolation(f"{what}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def as_dtype(value: Any, what: str) -> torch.dtype:
    """flashinfer's canonicalize_torch_dtype: a torch.dtype, or its name."""
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    require(isinstance(value, torch.dtype), f"{what} must be a torch.dtype or its name, got {value!r}")
    return value


# -- the device, emulated on the CPU -------------------------------------------------------------------


class FakeDevice:
    """Remembers which storages were allocated "on the GPU" (through `TorchOnFakeDevice`)."""

    def __init__(self) -> None:
        self._storages: set[int] = set()

    def allocate(self, factory: Callable, size: tuple, device: Any, kwargs: dict, garbage: bool) -> torch.Tensor:
        if device is None or torch.device(device).type != "cuda":
            return factory(*size, device=device, **kwargs)
        tensor = factory(*size, device="cpu", **kwargs)
        if garbage:  # device memory from torch.empty is whatever the allocator's last user left there
            tensor.view(torch.uint8).fill_(0xA5)
        self._storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._storages


class TorchOnFakeDevice:
    """`torch` as the backend module sees it in these tests: "cuda" allocations land on the CPU."""

    def __init__(self, device: FakeDevice) -> None:
        self._device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size, device=None, **kwargs) -> torch.Tensor:
        return self._device.allocate(torch.empty, size, device, kwargs, garbage=True)

    def zeros(self, *size, device=None, **kwargs) -> torch.Tensor:
        return self._device.allocate(torch.zeros, size, device, kwargs, garbage=False)

    def ones(self, *size, device=None, **kwargs) -> torch.Tensor:
        return self._device.allocate(torch.ones, size, device, kwargs, garbage=False)


# -- the fake flashinfer module -------------------------------------------------------------------------


def check_page_lists(
    indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int, what: str
) -> None:
    """kv_layout.rst's page-table layout: int32 CSR lists, 1 <= last_page_len <= page_size."""
    for name, tensor in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        require(isinstance(tensor, torch.Tensor) and tensor.dim() == 1, f"{what}: {name} must be a 1-D tensor")
        require(tensor.dtype == torch.int32, f"{what}: {name} must be int32, got {tensor.dtype}")
    batch = last_page_len.shape[0]
    require(indptr.shape[0] == batch + 1, f"{what}: indptr has {indptr.shape[0]} entries for a batch of {batch}")
    starts = indptr.tolist()
    require(starts[0] == 0, f"{what}: indptr must start at 0")
    require(all(b > a for a, b in zip(starts, starts[1:])), f"{what}: every request needs >= 1 page: {starts}")
    require(
        indices.shape[0] == starts[-1], f"{what}: indices has {indices.shape[0]} entries, indptr[-1] = {starts[-1]}"
    )
    lens = last_page_len.tolist()
    require(all(1 <= n <= page_size for n in lens), f"{what}: last_page_len outside [1, {page_size}]: {lens}")


@dataclass
class Plan:
    """What the kernels will read: in CUDA-graph mode the wrapper's fixed buffers, read at run time."""

    arguments: dict[str, Any]
    qo_indptr: list[int]
    kv_indptr: torch.Tensor
    kv_indices: Any  # a tensor; in CUDA-graph mode a _PrefixView of the indices buffer
    last_page_len: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype

    def page_lists(self) -> list[tuple[list[int], int]]:
        """Per request: (its pages, its KV length)."""
        starts, last = self.kv_indptr.tolist(), self.last_page_len.tolist()
        indices = self.kv_indices.tolist()
        return [(indices[a:b], (b - a - 1) * self.page_size + n) for a, b, n in zip(starts, starts[1:], last)]


@dataclass
class Run:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor


class FakeWrapper:
    """Common to the decode and prefill wrappers: binds, checks and records; run() computes attention."""

    kind = ""
    init_signature: Callable
    plan_signature: Callable
    run_signature: Callable
    flashinfer: FakeFlashInfer

    def __init__(self, *args, **kwargs) -> None:
        self.init_args = bind(self.init_signature, f"{type(self).__name__}()", args, kwargs)
        workspace = self.init_args["float_workspace_buffer"]
        require(
            isinstance(workspace, torch.Tensor) and workspace.dtype == torch.uint8,
            "float_workspace_buffer must be a uint8 tensor",
        )
        require(workspace.data_ptr() % 16 == 0, "float_workspace_buffer must be 16-byte aligned")
        require(self.flashinfer.device.owns(workspace), "float_workspace_buffer must be on the GPU")
        require(self.init_args["kv_layout"] == "NHD", "the pool is [pages, page_size, kv_heads, head_dim]: NHD")
        self.workspace = workspace
        self.plans: list[Plan] = []
        self.runs: list[Run] = []
        self.flashinfer.wrappers.append(self)

    @property
    def planned(self) -> Plan | None:
        return self.plans[-1] if self.plans else None

    def _record_plan(
        self, args: dict[str, Any], qo_indptr: list[int], indptr, indices, last_page_len, head_dim: int, causal: bool
    ) -> None:
        num_qo_heads, num_kv_heads, page_size = args["num_qo_heads"], args["num_kv_heads"], args["page_size"]
        require(num_qo_heads % num_kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads")
        require(args["pos_encoding_mode"] in POS_ENCODING_MODES, f"pos_encoding_mode {args['pos_encoding_mode']!r}")
        q_dtype = as_dtype(
            args["q_data_type"] if args["q_data_type"] is not None else args.get("data_type"), "q_data_type"
        )
        kv_value = args["kv_data_type"] if args["kv_data_type"] is not None else args.get("data_type")
        kv_dtype = q_dtype if kv_value is None else as_dtype(kv_value, "kv_data_type")
        sm_scale = args["sm_scale"] if args["sm_scale"] is not None else 1.0 / math.sqrt(head_dim)
        self.plans.append(
            Plan(
                args,
                qo_indptr,
                indptr,
                indices,
                last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal,
                sm_scale,
                q_dtype,
                kv_dtype,
            )
        )

    def run(self, *args, **kwargs) -> torch.Tensor:
        call = bind(self.run_signature, f"{type(self).__name__}.run()", args, kwargs)
        plan = self.planned
        require(plan is not None, "run() before plan()")
        require(call["args"] == (), "no custom-kernel *args for the default attention")
        require(call["out"] is None and call["lse"] is None, "the fake allocates its outputs itself")
        require(call["sinks"] is None, "sinks are taken by flashinfer's trtllm-gen kernels only")
        q, kv = call["q"], call["paged_kv_cache"]
        require(isinstance(kv, tuple) and len(kv) == 2, "paged_kv_cache is passed as a (k_cache, v_cache) tuple")
        k_cache, v_cache = kv
        pool_shape = (k_cache.shape[0], plan.page_size, plan.num_kv_heads, plan.head_dim)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            require(
                cache.dim() == 4 and tuple(cache.shape) == pool_shape,
                f"{name} must be NHD {pool_shape}, got {tuple(cache.shape)}",
            )
            require(cache.dtype == plan.kv_dtype, f"{name} is {cache.dtype}, kv_data_type {plan.kv_dtype}")
        require(q.dtype == plan.q_dtype, f"q is {q.dtype}, q_data_type {plan.q_dtype}")
        require(q.is_contiguous(), "q must be contiguous")
        expected_q = (plan.qo_indptr[-1], plan.num_qo_heads, plan.head_dim)
        require(tuple(q.shape) == expected_q, f"q must be {expected_q}, got {tuple(q.shape)}")
        pages = plan.page_lists()
        require(all(0 <= p < k_cache.shape[0] for request, _ in pages for p in request), "page index outside the pool")
        out, lse = paged_attention(q, k_cache, v_cache, plan)
        self.runs.append(Run(q, k_cache, v_cache, out))
        return (out, lse) if call["return_lse"] else out


class FakeDecodeWrapper(FakeWrapper):
    kind = "decode"
    init_signature = staticmethod(_decode_init)
    plan_signature = staticmethod(_decode_plan)
    run_signature = staticmethod(_decode_run)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        a = self.init_args
        self.use_cuda_graph = a["use_cuda_graph"]
        self.use_tensor_cores = a["use_tensor_cores"]
        self.buffers: dict[str, torch.Tensor] = {}
        if self.use_cuda_graph:
            for name in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"):
                buffer = a[name]
                require(isinstance(buffer, torch.Tensor), f"{name} should be a torch.Tensor in cudagraph mode")
                require(buffer.dtype == torch.int32 and buffer.dim() == 1, f"{name} must be a 1-D int32 tensor")
                require(self.flashinfer.device.owns(buffer), f"{name} must be on the GPU")
                self.buffers[name] = buffer
            self.fixed_batch_size = len(a["paged_kv_last_page_len_buffer"])
            require(
                len(a["paged_kv_indptr_buffer"]) == self.fixed_batch_size + 1,
                "The size of paged_kv_indptr_buffer should be batch_size + 1",
            )
            # what a captured graph reads: the buffers' memory, fixed for the wrapper's lifetime
            self.buffer_memory = {name: (b.data_ptr(), b.numel()) for name, b in self.buffers.items()}

    def plan(self, *args, **kwargs) -> None:
        a = bind(self.plan_signature, "BatchDecodeWithPagedKVCacheWrapper.plan()", args, kwargs)
        indptr, indices, last_page_len = a["indptr"], a["indices"], a["last_page_len"]
        check_page_lists(indptr, indices, last_page_len, a["page_size"], "decode plan")
        batch = last_page_len.shape[0]
        require(a["q_len_per_req"] == 1, "one query token per request")
        if self.use_cuda_graph:
            require(
                batch == self.fixed_batch_size,
                f"The batch size should be fixed in cudagraph mode: {batch} != {self.fixed_batch_size}",
            )
            indices_buffer = self.buffers["paged_kv_indices_buffer"]
            require(
                len(indices) <= len(indices_buffer),
                "The size of indices should be less than or equal to the allocated buffer",
            )
            # flashinfer copies the lists into the construction buffers, which the graph's kernels read
            self.buffers["paged_kv_indptr_buffer"].copy_(indptr)
            self.buffers["paged_kv_last_page_len_buffer"].copy_(last_page_len)
            indices_buffer[: len(indices)].copy_(indices)
            indptr = self.buffers["paged_kv_indptr_buffer"]
            last_page_len = self.buffers["paged_kv_last_page_len_buffer"]
            indices = _PrefixView(indices_buffer, indptr)
        self._record_plan(a, list(range(batch + 1)), indptr, indices, last_page_len, a["head_dim"], causal=False)


class _PrefixView:
    """indices_buffer[:indptr[-1]], evaluated when read (the kernel reads the buffer at replay)."""

    def __init__(self, buffer: torch.Tensor, indptr: torch.Tensor) -> None:
        self.buffer, self.indptr = buffer, indptr

    def tolist(self) -> list[int]:
        return self.buffer[: int(self.indptr[-1])].tolist()


class FakePrefillWrapper(FakeWrapper):
    kind = "prefill"
    init_signature = staticmethod(_prefill_init)
    plan_signature = staticmethod(_prefill_plan)
    run_signature = staticmethod(_prefill_run)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        require(not self.init_args["use_cuda_graph"], "the backend captures decode steps only")

    def plan(self, *args, **kwargs) -> None:
        a = bind(self.plan_signature, "BatchPrefillWithPagedKVCacheWrapper.plan()", args, kwargs)
        indptr, indices, last_page_len = a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"]
        check_page_lists(indptr, indices, last_page_len, a["page_size"], "prefill plan")
        qo_indptr = a["qo_indptr"]
        require(isinstance(qo_indptr, torch.Tensor) and qo_indptr.dtype == torch.int32, "qo_indptr must be int32")
        require(qo_indptr.shape == indptr.shape, "qo_indptr and paged_kv_indptr must both be [batch + 1]")
        qo = qo_indptr.tolist()
        require(qo[0] == 0 and all(b > a_ for a_, b in zip(qo, qo[1:])), f"qo_indptr must increase from 0: {qo}")
        require(a["head_dim_vo"] in (None, a["head_dim_qk"]), "head_dim_vo == head_dim_qk")
        require(a["custom_mask"] is None and a["packed_custom_mask"] is None, "the causal flag, not a custom mask")
        self._record_plan(a, qo, indptr, indices, last_page_len, a["head_dim_qk"], causal=a["causal"])
        plan = self.planned
        for (_pages, kv_len), q_len in zip(plan.page_lists(), (b - a_ for a_, b in zip(qo, qo[1:]))):
            require(q_len <= kv_len, f"a request's {q_len} queries must be the last of its {kv_len} KV tokens")


class FakeFlashInfer:
    """A `flashinfer` module whose wrapper classes record into this object."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.wrappers: list[FakeWrapper] = []
        self.module = types.ModuleType("flashinfer")
        self.module.__version__ = FLASHINFER_VERSION
        for base in (FakeDecodeWrapper, FakePrefillWrapper):
            public = base.__name__.replace("Fake", "Batch", 1).replace("Wrapper", "WithPagedKVCacheWrapper")
            setattr(self.module, public, type(public, (base,), {"flashinfer": self}))

    def of_kind(self, kind: str, graph: bool = False) -> list[FakeWrapper]:
        return [w for w in self.wrappers if w.kind == kind and getattr(w, "use_cuda_graph", False) == graph]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan
) -> tuple[torch.Tensor, torch.Tensor]:
    """What flashinfer computes from a plan: each request's queries against its pages' first kv_len tokens,
    causal masks aligned to the end of the KV (flashinfer's convention), a query at i seeing keys from
    i - window_left on (window_left >= 0), scores soft-capped with `logits_soft_cap`, float32 softmax; and
    the scores' log-sum-exp [T, H] in base 2 (what `return_lse` returns: the kernels' exp2 arithmetic)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    group = plan.num_qo_heads // plan.num_kv_heads
    for (pages, kv_len), start, end in zip(plan.page_lists(), plan.qo_indptr, plan.qo_indptr[1:]):
        index = torch.tensor(pages, dtype=torch.int64)
        keys = k_cache[index].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float()
        values = v_cache[index].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * plan.sm_scale
        cap = plan.arguments["logits_soft_cap"]
        if cap:  # flashinfer: cap * tanh(scaled score / cap)
            scores = torch.tanh(scores / cap) * cap
        query, keys = torch.arange(kv_len - (end - start), kv_len)[:, None], torch.arange(kv_len)[None, :]
        visible = keys <= query if plan.causal else torch.ones(len(query), kv_len, dtype=torch.bool)
        window_left = plan.arguments["window_left"]
        if window_left is not None and window_left >= 0:
            visible &= keys >= query - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
        lse[start:end] = (torch.logsumexp(scores, dim=-1) / math.log(2.0)).T
    return out, lse


# -- batches ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    slot: int
    prefix_len: int  # tokens already in the cache
    extend_len: int  # tokens this step feeds (1: a decode)


BATCHES = {
    # kv lengths 6, 12 (last page full), 1 (a one-token prompt), 8 (ends on a page boundary)
    "decode": [Request(0, 5, 1), Request(2, 11, 1), Request(3, 0, 1), Request(5, 7, 1)],
    "prefill": [Request(1, 0, 6), Request(4, 0, 9)],
    "mixed": [Request(0, 9, 1), Request(1, 0, 7), Request(2, 6, 5), Request(3, 3, 1)],
    # chunks after a cached prefix: one starting on a page boundary and ending on one, one crossing pages
    "chunked": [Request(2, 8, 4), Request(4, 13, 6)],
}


def make_cache(dtype: torch.dtype, seed: int = 0, ring_pages: int = 0) -> KVCache:
    """A CPU pool full of random K/V (the cached prefixes, and stale data elsewhere) and a page table
    giving each slot its own shuffled pages; the same seed gives the same cache. `ring_pages`: layer 0
    (the sliding one) keeps its KV in rings of that many pages."""
    cache = KVCache(
        num_layers=NUM_LAYERS,
        num_kv_heads=2,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_running_requests=MAX_RUNNING,
        max_pages_per_request=MAX_PAGES_PER_REQUEST,
        dtype=dtype,
        device=torch.device("cpu"),
        ring_layers=(0,) if ring_pages else (),
        ring_pages=ring_pages,
    )
    generator = torch.Generator().manual_seed(seed)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    pages = torch.randperm(NUM_PAGES - 1, generator=generator)[: MAX_RUNNING * MAX_PAGES_PER_REQUEST] + 1
    cache.page_table.copy_(pages.view(MAX_RUNNING, MAX_PAGES_PER_REQUEST).to(torch.int32))
    return cache


def metadata_for(cache: KVCache, requests: Sequence[Request], num_padding: int = 0) -> AttentionMetadata:
    """The step's metadata as the worker builds it; padded decode rows (graph sizes) write to page 0."""
    table = cache.page_table.tolist()
    kv_locs = [
        table[r.slot][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        for r in requests
        for pos in range(r.prefix_len, r.prefix_len + r.extend_len)
    ]
    return AttentionMetadata(
        slots=[r.slot for r in requests] + [0] * num_padding,
        prefix_lens=[r.prefix_len for r in requests] + [0] * num_padding,
        extend_lens=[r.extend_len for r in requests] + [1] * num_padding,
        kv_locs=torch.tensor(kv_locs + [0] * num_padding, dtype=torch.int64),
        num_padding=num_padding,
    )


def layer_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int):
    """Per layer: q [T, H, D], k and v [T, KVH, D]."""
    generator = torch.Generator().manual_seed(seed)
    return [
        tuple(
            torch.randn((num_tokens, heads, HEAD_DIM), generator=generator).to(dtype)
            for heads in (num_heads, num_kv_heads, num_kv_heads)
        )
        for _ in range(NUM_LAYERS)
    ]


# -- the two backends over the same batch ---------------------------------------------------------------


@dataclass
class Backends:
    flashinfer: Any
    fake: FakeFlashInfer
    flashinfer_cache: KVCache
    torch_backend: Any
    torch_cache: KVCache
    num_heads: int
    num_kv_heads: int = 2
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer: (ours, torch's)


def install_fake_flashinfer(monkeypatch, cache: KVCache) -> FakeFlashInfer:
    """The fake module importable as `flashinfer`, the backend module's allocations on the fake device, and
    the (CPU) cache labelled "cuda": the backend runs on CUDA only."""
    device = FakeDevice()
    fake = FakeFlashInfer(device)
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    monkeypatch.setattr(flashinfer_backend_module, "torch", TorchOnFakeDevice(device))
    monkeypatch.setattr(cache, "device", torch.device("cuda"))
    return fake


def flashinfer_backend(monkeypatch, cache: KVCache, num_heads: int, num_kv_heads: int = 2, windows=()):
    """The real flashinfer backend, created as the worker creates it, over the fake module and device."""
    fake = install_fake_flashinfer(monkeypatch, cache)
    return create_backend("flashinfer", cache, num_heads, num_kv_heads, HEAD_DIM, SCALE, windows), fake


def make_backends(
    monkeypatch,
    dtype: torch.dtype,
    num_heads: int = 4,
    windows=(),
    softcap: float = 0.0,
    ring_pages: int = 0,
    causal: bool = True,
) -> Backends:
    flashinfer_cache, torch_cache = make_cache(dtype, ring_pages=ring_pages), make_cache(dtype, ring_pages=ring_pages)
    fake = install_fake_flashinfer(monkeypatch, flashinfer_cache)
    backend = create_backend("flashinfer", flashinfer_cache, num_heads, 2, HEAD_DIM, SCALE, windows, softcap, causal)
    reference = create_backend("torch", torch_cache, num_heads, 2, HEAD_DIM, SCALE, windows, softcap, causal)
    return Backends(backend, fake, flashinfer_cache, reference, torch_cache, num_heads)


def run_step(
    backends: Backends,
    requests: Sequence[Request],
    num_padding: int = 0,
    graph: bool = False,
    seed: int = 1,
    sinks: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Plan both backends for the batch and run every layer (with `sinks` [layers, heads], attention sinks);
    outputs go to `backends.outputs`."""
    flashinfer_metadata = metadata_for(backends.flashinfer_cache, requests, num_padding)
    torch_metadata = metadata_for(backends.torch_cache, requests, num_padding)
    (backends.flashinfer.plan_cuda_graph if graph else backends.flashinfer.plan)(flashinfer_metadata)
    backends.torch_backend.plan(torch_metadata)
    backends.outputs = []
    dtype = backends.flashinfer_cache.dtype
    for layer, (q, k, v) in enumerate(
        layer_inputs(flashinfer_metadata.num_tokens, backends.num_heads, backends.num_kv_heads, dtype, seed)
    ):
        sink = None if sinks is None else sinks[layer]
        backends.outputs.append(
            (backends.flashinfer.forward(q, k, v, layer, sink), backends.torch_backend.forward(q, k, v, layer, sink))
        )
    return torch_metadata


def torch_page_lists(backend, metadata: AttentionMetadata, page_size: int) -> list[tuple[list[int], int]]:
    """Per request, in batch order: (pages, kv_len) the torch backend reads after plan(). Decode rows (and
    short rows after a cached prefix) read `decode.pages` / `decode.lens` of its plan; a longer chunk after a
    cached prefix reads its gathered pages up to its mask width; a fresh prompt attends to its own new K/V,
    i.e. the tokens written at its kv_locs."""
    decode_rows = 0
    step = backend._plans[0]
    prefills = iter(step.prefills)
    lists = []
    for prefix_len, extend_len in zip(metadata.prefix_lens, metadata.extend_lens):
        if extend_len == 1 or prefix_len and extend_len <= MAX_DECODE_ROW_TOKENS:
            # a short row after a cached prefix is one decode row per token; its last reads the whole KV
            decode_rows += extend_len
            row = step.decode.pages[decode_rows - 1].tolist()
            kv_len = int(step.decode.lens[decode_rows - 1])
        else:
            chunk = next(prefills)
            if chunk.pages is None:
                locs = metadata.kv_locs[chunk.start : chunk.start + chunk.length].tolist()
                assert [loc % page_size for loc in locs] == [i % page_size for i in range(len(locs))]
                row, kv_len = [loc // page_size for loc in locs[::page_size]], len(locs)
            else:
                row, kv_len = chunk.pages.tolist(), chunk.mask.shape[1]
        lists.append((row[: -(-kv_len // page_size)], kv_len))
    return lists


def assert_documented_plan(plan: Plan, backends: Backends, metadata: AttentionMetadata, prefill: bool) -> None:
    """The plan's arguments say what the model means: its shapes, dtype and scale, RoPE already applied."""
    cache = backends.flashinfer_cache
    args = plan.arguments
    assert (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size) == (
        backends.num_heads,
        backends.num_kv_heads,
        HEAD_DIM,
        PAGE_SIZE,
    )
    assert args["pos_encoding_mode"] == "NONE"  # the model rotates q/k itself
    assert plan.q_dtype == plan.kv_dtype == cache.dtype
    assert args["o_data_type"] is None  # output in q's dtype
    assert args["sm_scale"] == SCALE
    assert args["window_left"] == -1 and args["logits_soft_cap"] is None
    assert plan.causal == prefill
    expected_qo = [0]
    for n in metadata.extend_lens:
        expected_qo.append(expected_qo[-1] + n)
    assert plan.qo_indptr == expected_qo


def assert_outputs_match(backends: Backends, rows: slice = slice(None)) -> None:
    tolerance = TOLERANCE[backends.flashinfer_cache.dtype]
    for layer, (got, want) in enumerate(backends.outputs):
        assert got.shape == want.shape and got.dtype == want.dtype, f"layer {layer}"
        torch.testing.assert_close(got[rows], want[rows], **tolerance, msg=lambda m, layer=layer: f"layer {layer}: {m}")
    for ours, theirs in zip(
        (*backends.flashinfer_cache.k, *backends.flashinfer_cache.v), (*backends.torch_cache.k, *backends.torch_cache.v)
    ):
        assert torch.equal(ours, theirs), "the two backends wrote different K/V into the pool"


# -- tests --------------------------------------------------------------------------------------------


def test_gpu_extra_pins_the_checked_flashinfer_version():
    """The contract below is flashinfer 0.7.4's: a new pin means re-reading its API and updating this file."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    flashinfer = [d for d in pyproject["project"]["optional-dependencies"]["gpu"] if d.startswith("flashinfer")]
    assert flashinfer == [f"flashinfer-python=={FLASHINFER_VERSION}"]


@pytest.mark.parametrize("num_heads, tensor_cores", [(4, False), (8, True)])
def test_backend_builds_the_documented_wrappers(monkeypatch, num_heads, tensor_cores):
    backend, fake = flashinfer_backend(monkeypatch, make_cache(torch.bfloat16), num_heads)
    [decode], [prefill] = fake.of_kind("decode"), fake.of_kind("prefill")
    assert decode.workspace is prefill.workspace  # one float workspace, shared
    assert decode.workspace.numel() == flashinfer_backend_module.WORKSPACE_BYTES
    assert decode.init_args["use_tensor_cores"] is tensor_cores  # group size 4 or more
    assert not decode.use_cuda_graph and not prefill.init_args["use_cuda_graph"]
    assert not fake.of_kind("decode", graph=True)  # graph wrappers only from init_cuda_graphs


def test_float32_is_refused_before_any_wrapper(monkeypatch):
    cache = make_cache(torch.float32)
    fake = install_fake_flashinfer(monkeypatch, cache)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        create_backend("flashinfer", cache, 4, 2, HEAD_DIM, SCALE)
    assert not fake.wrappers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_plan_and_forward_match_the_torch_backend(monkeypatch, batch, dtype):
    backends = make_backends(monkeypatch, dtype)
    metadata = run_step(backends, BATCHES[batch])
    prefill = batch != "decode"
    [wrapper] = [w for w in backends.fake.wrappers if w.plans]  # one wrapper planned, once for all layers
    assert wrapper.kind == ("prefill" if prefill else "decode") and len(wrapper.plans) == 1
    assert len(wrapper.runs) == NUM_LAYERS
    plan = wrapper.planned
    assert_documented_plan(plan, backends, metadata, prefill)
    # (b) the planned page lists are the KV the torch backend reads for each request
    assert plan.page_lists() == torch_page_lists(backends.torch_backend, metadata, PAGE_SIZE)
    # the kernels read the pool in place
    cache = backends.flashinfer_cache
    assert all(run.k_cache is k and run.v_cache is v for run, k, v in zip(wrapper.runs, cache.k, cache.v))
    # (c) attention over that KV is the torch backend's attention
    assert_outputs_match(backends)


def test_bidirectional_encoder_rows_match_the_torch_backend(monkeypatch):
    """An encoder's (BERT's) whole inputs: the prefill wrapper planned with causal=False, every token of a
    row attending to every other, as the torch backend's non-causal mode."""
    backends = make_backends(monkeypatch, torch.bfloat16, causal=False)
    run_step(backends, BATCHES["prefill"])
    [wrapper] = [w for w in backends.fake.wrappers if w.plans]
    assert wrapper.planned.causal is False
    assert_outputs_match(backends)
    causal = make_backends(monkeypatch, torch.bfloat16)  # and it is not the causal attention
    run_step(causal, BATCHES["prefill"])
    assert not torch.allclose(causal.outputs[0][1], backends.outputs[0][1])


def test_wider_gqa_group_matches_the_torch_backend(monkeypatch):
    """8 query heads on 2 KV heads (tensor-core decode): query head h reads KV head h // 4 in both."""
    backends = make_backends(monkeypatch, torch.bfloat16, num_heads=8)
    for name in ("decode", "mixed"):
        run_step(backends, BATCHES[name])
        assert_outputs_match(backends)


# every batch eagerly, and the decode batch (graphs capture decode steps) through a CUDA graph's plan too
@pytest.mark.parametrize("batch, graph", [(name, False) for name in BATCHES] + [("decode", True)])
def test_sliding_window_layers_match_the_torch_backend(monkeypatch, batch, graph):
    """A layer with a window of 3 (decode rows and chunks longer than it) beside a full one: one wrapper
    per window, planned with window_left = 2 and -1; each layer runs its own; the torch backend agrees."""
    backends = make_backends(monkeypatch, torch.bfloat16, windows=(3, 0))
    if graph:
        backends.flashinfer.init_cuda_graphs([len(BATCHES[batch])])
    run_step(backends, BATCHES[batch], graph=graph)
    planned = [w for w in backends.fake.wrappers if w.plans]
    assert sorted(w.planned.arguments["window_left"] for w in planned) == [-1, 2]
    assert all(len(w.runs) == 1 for w in planned)  # one layer each
    assert_outputs_match(backends)
    full = make_backends(monkeypatch, torch.bfloat16)  # the window does change the sliding layer's output
    run_step(full, BATCHES[batch], graph=False)
    assert not torch.allclose(full.outputs[0][1], backends.outputs[0][1])


@pytest.mark.parametrize("batch", list(BATCHES))
def test_soft_capped_scores_match_the_torch_backend(monkeypatch, batch):
    """Gemma 2's attention soft-capping: planned as logits_soft_cap, the torch backend's eager arithmetic."""
    backends = make_backends(monkeypatch, torch.bfloat16, windows=(3, 0), softcap=0.5)
    run_step(backends, BATCHES[batch])
    assert {w.planned.arguments["logits_soft_cap"] for w in backends.fake.wrappers if w.plans} == {0.5}
    assert_outputs_match(backends)


@pytest.mark.parametrize("batch, graph", [(name, False) for name in BATCHES] + [("decode", True)])
def test_attention_sinks_match_the_torch_backend(monkeypatch, batch, graph):
    """gpt-oss's sinks: the wrappers run with return_lse and the output is rescaled by the keys' share
    beside each head's sink; the torch backend joins the sink to its softmax. Sinks large enough to take
    most of the weight, so a dropped or misplaced one shows."""
    backends = make_backends(monkeypatch, torch.bfloat16, windows=(3, 0))
    if graph:
        backends.flashinfer.init_cuda_graphs([len(BATCHES[batch])])
    sinks = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 4.0, -2.0, 1.0]])
    run_step(backends, BATCHES[batch], graph=graph, sinks=sinks)
    assert_outputs_match(backends)
    plain = make_backends(monkeypatch, torch.bfloat16, windows=(3, 0))
    run_step(plain, BATCHES[batch])
    assert not torch.allclose(plain.outputs[1][1], backends.outputs[1][1])


@pytest.mark.parametrize("batch, graph", [(name, False) for name in BATCHES] + [("decode", True)])
def test_ring_layers_match_the_torch_backend(monkeypatch, batch, graph):
    """A sliding layer whose KV lies in rings of 3 pages (a window of 3 and steps of up to 5 tokens after a
    cached prefix fit): its page lists are the ring table's, its new K/V go to the ring locations (in a
    graph, through the backend's static buffer), as the torch backend writes and reads them."""
    backends = make_backends(monkeypatch, torch.bfloat16, windows=(3, 0), ring_pages=4)
    if graph:
        backends.flashinfer.init_cuda_graphs([len(BATCHES[batch])])
    metadata = run_step(backends, BATCHES[batch], graph=graph)
    assert_outputs_match(backends)
    ring, table = backends.flashinfer_cache.ring_table.tolist(), backends.flashinfer_cache.page_table.tolist()
    planned = {w.planned.arguments["window_left"]: w.planned for w in backends.fake.wrappers if w.plans}
    for window_left, rows in ((2, ring), (-1, table)):
        for request, (pages, kv_len) in zip(BATCHES[batch], planned[window_left].page_lists()):
            assert pages == rows[request.slot][: len(pages)] and kv_len == request.prefix_len + request.extend_len
    ring_locs = backends.flashinfer_cache.ring_locs(metadata.slots, metadata.prefix_lens, metadata.extend_lens)
    assert ring_locs.max() < backends.flashinfer_cache.pool_pages(0) * PAGE_SIZE
    assert not np.array_equal(ring_locs, metadata.kv_locs.numpy())


GRAPH_SIZES = [1, 2, 4, 8]


def test_cuda_graph_buffers_are_fixed_at_init_and_rewritten_in_place(monkeypatch):
    backends = make_backends(monkeypatch, torch.bfloat16)
    backends.flashinfer.init_cuda_graphs(GRAPH_SIZES)
    graph_wrappers = {w.fixed_batch_size: w for w in backends.fake.of_kind("decode", graph=True)}
    assert sorted(graph_wrappers) == GRAPH_SIZES
    for _size, wrapper in graph_wrappers.items():
        assert wrapper.workspace is backends.fake.of_kind("decode")[0].workspace
        assert wrapper.init_args["use_tensor_cores"] is False
        # room for the largest plan: every row of the largest size at the most pages a request may hold
        assert len(wrapper.buffers["paged_kv_indices_buffer"]) >= max(GRAPH_SIZES) * MAX_PAGES_PER_REQUEST

    steps = [  # (real requests, padded size): replans of the same and of other sizes
        ([Request(0, 5, 1), Request(2, 11, 1), Request(5, 7, 1)], 4),
        ([Request(3, 30, 1)], 2),  # a request at its last page-table column
        ([Request(0, 12, 1), Request(1, 0, 1), Request(2, 17, 1), Request(4, 3, 1)], 4),
        ([Request(slot, 6 + slot, 1) for slot in range(MAX_RUNNING)], 8),
    ]
    for step, (requests, size) in enumerate(steps):
        padding = size - len(requests)
        metadata = run_step(backends, requests, num_padding=padding, graph=True, seed=10 + step)
        wrapper = graph_wrappers[size]
        plan = wrapper.planned
        assert wrapper.runs and wrapper.runs[-1].q.shape[0] == size
        # the kernels read the construction buffers, never reallocated
        assert {n: (b.data_ptr(), b.numel()) for n, b in wrapper.buffers.items()} == wrapper.buffer_memory
        assert plan.kv_indptr is wrapper.buffers["paged_kv_indptr_buffer"]
        lists = plan.page_lists()
        # (d) padded rows: the dummy page 0 holding one token
        assert lists[len(requests) :] == [([0], 1)] * padding
        assert plan.last_page_len[len(requests) :].tolist() == [1] * padding
        # real rows (and padding) as the torch backend reads them
        assert lists == torch_page_lists(backends.torch_backend, metadata, PAGE_SIZE)
        assert_documented_plan(plan, backends, metadata, prefill=False)
        assert_outputs_match(backends)


def test_cuda_graph_plan_needs_an_initialised_size(monkeypatch):
    backends = make_backends(monkeypatch, torch.float16)
    backends.flashinfer.init_cuda_graphs([1, 2, 4])
    with pytest.raises(ValueError, match="batch size 3"):
        backends.flashinfer.plan_cuda_graph(metadata_for(backends.flashinfer_cache, BATCHES["decode"][:3]))
    assert not any(w.plans for w in backends.fake.wrappers)


def test_decode_workspace_is_zeroed_before_first_use(monkeypatch):
    backend, fake = flashinfer_backend(monkeypatch, make_cache(torch.bfloat16), 4)
    backend.init_cuda_graphs([1, 2])
    for wrapper in fake.of_kind("decode") + fake.of_kind("decode", graph=True):
        assert not wrapper.workspace.any(), "the decode wrapper's float workspace holds leftover bytes"


# -- the fake enforces the contract (so a backend that breaks it fails the tests above) -----------------


def fake_decode_wrapper(monkeypatch) -> FakeDecodeWrapper:
    backend, fake = flashinfer_backend(monkeypatch, make_cache(torch.float16), 4)
    return fake.of_kind("decode")[0]


def decode_plan_call(
    indptr=(0, 2, 3),
    indices=(5, 6, 9),
    last_page_len=(3, 1),
    index_dtype=torch.int32,
    shape=(4, 2, HEAD_DIM, PAGE_SIZE),
    positional_options=(),
    **keywords,
):
    """(args, kwargs) of a documented decode plan() call, give or take the changes asked for."""
    lists = [torch.tensor(values, dtype=index_dtype) for values in (indptr, indices, last_page_len)]
    return (*lists, *shape, *positional_options), dict(q_data_type=torch.float16, **keywords)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q_datatype=torch.float16), "unexpected keyword"),
        (dict(shape=(4, 2, HEAD_DIM)), "page_size"),
        (dict(positional_options=("NONE",)), "too many positional"),  # deprecated in 0.7.4
        (dict(index_dtype=torch.int64), "int32"),
        (dict(last_page_len=(3, 0)), "last_page_len"),
        (dict(last_page_len=(3, 5)), "last_page_len"),
        (dict(indices=(5, 6)), "indptr"),
    ],
    ids=[
        "misspelled-keyword",
        "missing-page-size",
        "positional-option",
        "int64-lists",
        "empty-last-page",
        "last-page-over-page-size",
        "indices-short-of-indptr",
    ],
)
def test_the_fake_rejects_contract_violations(monkeypatch, change, message):
    wrapper = fake_decode_wrapper(monkeypatch)
    args, kwargs = decode_plan_call()
    wrapper.plan(*args, **kwargs)  # the documented call is accepted
    args, kwargs = decode_plan_call(**change)
    with pytest.raises(ContractViolation, match=message):
        wrapper.plan(*args, **kwargs)


def test_the_fake_rejects_a_run_in_the_wrong_dtype_or_layout(monkeypatch):
    wrapper = fake_decode_wrapper(monkeypatch)
    args, kwargs = decode_plan_call()
    wrapper.plan(*args, **kwargs)
    k_pool = torch.zeros((16, PAGE_SIZE, 2, HEAD_DIM), dtype=torch.float16)
    q = torch.zeros((2, 4, HEAD_DIM), dtype=torch.float16)
    wrapper.run(q, (k_pool, k_pool))  # the documented call runs
    with pytest.raises(ContractViolation, match="q is torch.bfloat16"):
        wrapper.run(q.bfloat16(), (k_pool, k_pool))
    with pytest.raises(ContractViolation, match="NHD"):
        wrapper.run(q, (k_pool.transpose(1, 2), k_pool.transpose(1, 2)))
    with pytest.raises(ContractViolation, match="must be"):
        wrapper.run(q[:1], (k_pool, k_pool))
