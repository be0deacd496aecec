"""The padded static-buffer decode path (CUDA graphs' logic, run eagerly on CPU) and the flashinfer
backend's CPU-checkable parts: same tokens and logits as the unpadded eager path at every batch size,
padding never touching real KV, bucket choice, the disable flag, and eager fallbacks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from model_batches import GREEDY, generate_greedy

from batchserve.kernels import native
from batchserve.kernels.attention import AttentionMetadata, create_backend, resolve_backend_name
from batchserve.kernels.attention.flashinfer import page_lists
from batchserve.kernels.decode_layers import DecodeLayers
from batchserve.procs.worker.graph_runner import capture_sizes
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import ForwardBatch

MAX_RUNNING = 10
PAGE_SIZE = 4
PAGES_PER_REQUEST = 4  # 16 tokens: prompts up to 9 plus a few decode steps


def make_runner(model_dir, **kwargs) -> ModelRunner:
    """A CPU runner that takes the padded path (which CUDA graphs replay) for decode steps."""
    kwargs.setdefault("max_running_requests", MAX_RUNNING)
    kwargs.setdefault("pad_decode", True)
    return ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        page_size=PAGE_SIZE,
        kv_capacity_tokens=PAGE_SIZE * PAGES_PER_REQUEST * MAX_RUNNING,
        **kwargs,
    )


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def padded_runner(model_dir) -> ModelRunner:
    return make_runner(model_dir)


@pytest.fixture(scope="module")
def eager_runner(model_dir) -> ModelRunner:
    return make_runner(model_dir, disable_cuda_graph=True)


def prompts_for(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(rng.integers(3, 10))).tolist() for _ in range(count)]


# -- a minimal planner: request i of a batch owns slot slots[i] and pages 1 + 4i .. 4 + 4i ---------


@dataclass
class Request:
    slot: int
    pages: list[int]
    fed: int = 0
    last_token: int = 0
    sampled: list[int] = field(default_factory=list)

    def kv_loc(self, position: int) -> int:
        return self.pages[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE


def i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def prefill(runner: ModelRunner, prompts: list[list[int]], slots: list[int]) -> list[Request]:
    requests = [
        Request(slot, list(range(1 + PAGES_PER_REQUEST * i, 1 + PAGES_PER_REQUEST * (i + 1))))
        for i, slot in enumerate(slots)
    ]
    batch = ForwardBatch(
        step=0,
        slots=list(slots),
        prefix_lens=[0] * len(slots),
        extend_lens=[len(p) for p in prompts],
        sample_lens=[1] * len(slots),
        sampling=[GREEDY] * len(slots),
        sample_counts=[0] * len(slots),
        input_ids=i32([t for p in prompts for t in p]),
        positions=i32([i for p in prompts for i in range(len(p))]),
        kv_locs=i32([r.kv_loc(i) for r, p in zip(requests, prompts) for i in range(len(p))]),
        page_table_slots=i32(np.repeat(slots, PAGES_PER_REQUEST)),
        page_table_cols=i32(np.tile(np.arange(PAGES_PER_REQUEST), len(slots))),
        page_table_pages=i32([page for r in requests for page in r.pages]),
    )
    tokens = runner.execute(batch).next_token_ids.tolist()
    for r, p, token in zip(requests, prompts, tokens):
        r.fed, r.last_token = len(p), token
    return requests


def decode_batch(requests: list[Request], step: int = 1, sample_lens: list[int] | None = None) -> ForwardBatch:
    n = len(requests)
    return ForwardBatch(
        step=step,
        slots=[r.slot for r in requests],
        prefix_lens=[r.fed for r in requests],
        extend_lens=[1] * n,
        sample_lens=sample_lens or [1] * n,
        sampling=[GREEDY] * n,
        sample_counts=[1] * n,
        input_ids=i32([r.last_token for r in requests]),
        positions=i32([r.fed for r in requests]),
        kv_locs=i32([r.kv_loc(r.fed) for r in requests]),
        page_table_slots=i32([]),
        page_table_cols=i32([]),
        page_table_pages=i32([]),
    )


def eager_logits(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """The plain eager path on the same runner and KV state (rewrites the same K/V: idempotent)."""
    graph_runner, runner.graph_runner = runner.graph_runner, None
    try:
        with torch.inference_mode():
            return runner.forward_logits(batch)
    finally:
        runner.graph_runner = graph_runner


# -- buckets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_bs, sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (10, [1, 2, 4, 8, 10]),
        (16, [1, 2, 4, 8, 16]),
        (17, [1, 2, 4, 8, 16, 17]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_capture_sizes(max_bs, sizes):
    assert capture_sizes(max_bs) == sizes


def test_capture_sizes_rejects_zero():
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_is_smallest_captured_size_at_least_batch(padded_runner):
    graph_runner = padded_runner.graph_runner
    assert graph_runner.batch_sizes == [1, 2, 4, 8, 10]
    assert [graph_runner.bucket_for(b) for b in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10]
    with pytest.raises(ValueError):
        graph_runner.bucket_for(11)
    assert not graph_runner.uses_cuda_graphs  # CPU: the padded path runs eagerly


# -- padded == unpadded -----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", range(1, MAX_RUNNING + 1))
def test_padded_logits_match_unpadded_eager(padded_runner, batch_size):
    graph_runner = padded_runner.graph_runner
    requests = prefill(padded_runner, prompts_for(batch_size, seed=batch_size), slots=list(range(batch_size))[::-1])
    batch = decode_batch(requests)
    bucket = graph_runner.bucket_for(batch_size)
    before = graph_runner.steps_per_size[bucket]
    with torch.inference_mode():
        padded = padded_runner.forward_logits(batch)
    assert graph_runner.steps_per_size[bucket] == before + 1
    expected = eager_logits(padded_runner, batch)
    assert padded.shape == (batch_size, padded_runner.vocab_size)
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("batch_size", range(1, MAX_RUNNING + 1))
def test_padded_generation_matches_unpadded(padded_runner, eager_runner, batch_size):
    prompts = prompts_for(batch_size, seed=100 + batch_size)
    assert generate_greedy(padded_runner, prompts, 4) == generate_greedy(eager_runner, prompts, 4)


def test_padded_generation_matches_with_staggered_arrivals(padded_runner, eager_runner):
    """Batch sizes change from step to step (requests join and finish), chunked prefills in between."""
    prompts = prompts_for(MAX_RUNNING, seed=7)
    padded = generate_greedy(padded_runner, prompts, 5, chunk=3, arrival_gap=1)
    assert padded == generate_greedy(eager_runner, prompts, 5, chunk=3, arrival_gap=1)


def test_non_sampling_rows_are_dropped(padded_runner):
    requests = prefill(padded_runner, prompts_for(3, seed=11), slots=[0, 1, 2])
    batch = decode_batch(requests, sample_lens=[1, 0, 1])
    with torch.inference_mode():
        padded = padded_runner.forward_logits(batch)
    torch.testing.assert_close(padded, eager_logits(padded_runner, batch), rtol=1e-5, atol=1e-5)
    assert padded.shape[0] == 2


def wide_batch(requests: list[Request], widths: list[int]) -> ForwardBatch:
    """Decode rows of `widths[i]` tokens: request i's last token, then tokens 7, 8, ... proposed after it."""
    rows = [[r.last_token, *range(7, 6 + k)] for r, k in zip(requests, widths)]
    positions = [r.fed + j for r, k in zip(requests, widths) for j in range(k)]
    owners = [r for r, k in zip(requests, widths) for _ in range(k)]
    n = len(requests)
    return ForwardBatch(
        step=1,
        slots=[r.slot for r in requests],
        prefix_lens=[r.fed for r in requests],
        extend_lens=list(widths),
        sample_lens=list(widths),
        sampling=[GREEDY] * n,
        sample_counts=[1] * n,
        input_ids=i32([t for row in rows for t in row]),
        positions=i32(positions),
        kv_locs=i32([r.kv_loc(p) for r, p in zip(owners, positions)]),
        page_table_slots=i32([]),
        page_table_cols=i32([]),
        page_table_pages=i32([]),
    )


@pytest.mark.parametrize("widths", [[2, 2, 2], [1, 3, 1]])
def test_rows_wider_than_one_token_run_eagerly(padded_runner, widths):
    """Graphs are captured for one token per row: wider rows (all, or some) take the eager path."""
    graph_runner = padded_runner.graph_runner
    requests = prefill(padded_runner, prompts_for(3, seed=21), slots=[0, 1, 2])
    batch = wide_batch(requests, widths)
    assert not graph_runner.handles(batch)
    before = sum(graph_runner.steps_per_size.values())
    with torch.inference_mode():
        logits = padded_runner.forward_logits(batch)
    assert sum(graph_runner.steps_per_size.values()) == before
    assert logits.shape == (sum(widths), padded_runner.vocab_size)
    torch.testing.assert_close(logits, eager_logits(padded_runner, batch))
    one_each = wide_batch(requests, [1, 1, 1])
    assert graph_runner.handles(one_each) and one_each.extend_lens == one_each.sample_lens == [1, 1, 1]
    with torch.inference_mode():
        padded_runner.forward_logits(one_each)
    assert sum(graph_runner.steps_per_size.values()) == before + 1


# -- padding never touches real KV ------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["per-op", "one-call"])
@pytest.mark.parametrize("batch_size", [3, 5])
def test_padding_writes_and_reads_only_the_dummy_page(model_dir, batch_size, fused):
    runner = make_runner(model_dir)
    assert runner.model.fuse_decode_layers or not native.available()
    runner.model.fuse_decode_layers = fused and runner.model.fuse_decode_layers
    cache = runner.kv_cache
    generator = torch.Generator().manual_seed(0)
    for pool in (*cache.k, *cache.v):  # every real page holds distinct finite values
        pool[1:] = torch.randn(pool[1:].shape, generator=generator)
    # real requests sit in slots 5.. ; padded rows are given slot 0, whose page-table row points at a
    # page full of NaN: a padded row that read through its slot would turn NaN
    requests = prefill(runner, prompts_for(batch_size, seed=3), slots=list(range(5, 5 + batch_size)))
    poisoned = cache.num_pages - 1
    for pool in (*cache.k, *cache.v):
        pool[poisoned] = float("nan")
    cache.page_table[0] = poisoned
    batch = decode_batch(requests)
    size = runner.graph_runner.bucket_for(batch_size)
    assert size > batch_size

    # Every row's output: each layer's attention (per op), or the final norm (all layers in one call).
    outputs = []
    if runner.model.fuse_decode_layers:
        run = DecodeLayers.run

        def spy(self, *args, **kwargs):
            outputs.append(run(self, *args, **kwargs))
            return outputs[-1]

        patched = (DecodeLayers, "run", spy)
    else:
        forward = runner.attention.forward

        def spy_forward(q, k, v, layer, sinks=None):
            outputs.append(forward(q, k, v, layer, sinks))
            return outputs[-1]

        patched = (runner.attention, "forward", spy_forward)
    before = [t.clone() for t in (*cache.k_flat, *cache.v_flat)]
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(*patched)
        runner.forward_logits(batch)

    assert len(outputs) == (1 if runner.model.fuse_decode_layers else runner.config.num_layers)
    assert all(out.shape[0] == size for out in outputs)
    assert all(torch.isfinite(out[batch_size:]).all() for out in outputs), "a padded row read beyond the dummy page"
    real_locs = set(batch.kv_locs.tolist())
    for old, new in zip(before, (*cache.k_flat, *cache.v_flat)):
        differs = ~((old == new) | (old.isnan() & new.isnan()))
        changed = set(torch.nonzero(differs.flatten(1).any(dim=1)).flatten().tolist())
        assert changed - set(range(PAGE_SIZE)) == real_locs  # real rows' locations, and page 0 only


def test_page_lists_for_padded_decode():
    """flashinfer's page lists (CPU-checkable): real rows follow the page table, padding gets page 0."""
    page_table = torch.zeros((4, 3), dtype=torch.int32)
    page_table[2] = torch.tensor([7, 3, 9], dtype=torch.int32)
    page_table[1] = torch.tensor([5, 0, 0], dtype=torch.int32)
    metadata = AttentionMetadata(
        slots=[2, 1, 0, 0],
        prefix_lens=[8, 3, 0, 0],
        extend_lens=[1, 1, 1, 1],
        kv_locs=torch.zeros(4, dtype=torch.int64),
        num_padding=2,
    )
    pages = page_lists(metadata, page_table, page_size=4)
    assert pages.indptr.tolist() == [0, 3, 4, 5, 6]
    assert pages.indices.tolist() == [7, 3, 9, 5, 0, 0]
    assert pages.last_page_len.tolist() == [1, 4, 1, 1]
    assert pages.indptr.dtype == pages.indices.dtype == pages.last_page_len.dtype == torch.int32


def test_page_lists_for_mixed_prefill_and_decode():
    page_table = torch.tensor([[4, 6, 0], [2, 0, 0]], dtype=torch.int32)
    metadata = AttentionMetadata(
        slots=[1, 0], prefix_lens=[0, 5], extend_lens=[3, 4], kv_locs=torch.zeros(7, dtype=torch.int64)
    )
    pages = page_lists(metadata, page_table, page_size=4)
    assert pages.indptr.tolist() == [0, 1, 4]
    assert pages.indices.tolist() == [2, 4, 6, 0]
    assert pages.last_page_len.tolist() == [3, 1]


# -- switches and fallbacks -------------------------------------------------------------------------


def test_disable_cuda_graph_runs_plain_eager(model_dir, eager_runner):
    assert eager_runner.graph_runner is None
    config = ServerConfig(
        model=str(model_dir),
        device="cpu",
        page_size=PAGE_SIZE,
        kv_capacity_tokens=256,
        max_running_requests=MAX_RUNNING,
        disable_cuda_graph=True,
    )
    assert ModelRunner.from_config(config).graph_runner is None


def test_cpu_decode_runs_unpadded_by_default(model_dir):
    """Nothing is captured on CPU, so padding would only cost: decode takes the plain eager path."""
    config = ServerConfig(
        model=str(model_dir),
        device="cpu",
        page_size=PAGE_SIZE,
        kv_capacity_tokens=256,
        max_running_requests=MAX_RUNNING,
    )
    assert ModelRunner.from_config(config).graph_runner is None
    assert make_runner(model_dir, pad_decode=None).graph_runner is None


def test_cuda_graph_max_bs_caps_buckets(model_dir):
    assert make_runner(model_dir, cuda_graph_max_bs=4).graph_runner.batch_sizes == [1, 2, 4]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        make_runner(model_dir, cuda_graph_max_bs=-1)
    assert make_runner(model_dir, cuda_graph_max_bs=64).graph_runner.max_batch_size == MAX_RUNNING


def test_batches_beyond_largest_bucket_and_prefills_run_eagerly(model_dir):
    runner = make_runner(model_dir, cuda_graph_max_bs=4)
    graph_runner = runner.graph_runner
    requests = prefill(runner, prompts_for(6, seed=5), slots=list(range(6)))
    assert not graph_runner.steps_per_size  # prefill steps never take the padded path
    batch = decode_batch(requests)
    assert not graph_runner.handles(batch)
    with torch.inference_mode():
        logits = runner.forward_logits(batch)
    assert not graph_runner.steps_per_size
    torch.testing.assert_close(logits, eager_logits(runner, batch))
    assert graph_runner.handles(decode_batch(requests[:4]))


def test_flashinfer_unavailable_on_cpu_is_a_clear_error(model_dir, padded_runner):
    # fp32 on the CPU: the C decode kernel where it builds
    assert resolve_backend_name("auto", "cpu") == ("cpu" if native.available() else "torch")
    assert resolve_backend_name("auto", "cpu", torch.bfloat16) == "torch"
    assert resolve_backend_name("auto", "cuda", torch.float32) == "torch"
    with pytest.raises(ValueError, match="flashinfer"):
        create_backend("flashinfer", padded_runner.kv_cache, 4, 2, 16, 0.25)
    with pytest.raises(ValueError, match="flashinfer"):
        make_runner(model_dir, attention_backend="flashinfer")
