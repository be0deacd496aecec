"""ModelRunner contract: KV sizing, page-table updates, malformed batches rejected, sampling wiring."""

from __future__ import annotations

import numpy as np
import pytest

from model_batches import GREEDY, _plan, _Request, generate_greedy
from procs.worker.kv_cache import GIB, kv_bytes_per_token, num_pages_for
from procs.worker import model_runner
from procs.worker.model_runner import ModelRunner
from shared.messages import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir("llama"), device="cpu", page_size=4, kv_capacity_tokens=256,
                       max_running_requests=4, max_context=64)


def _prefill(prompts, page_size, slots=None, free_pages=None):
    requests = [_Request(p, 0, slot=i if slots is None else slots[i]) for i, p in enumerate(prompts)]
    free = list(range(60, 0, -1)) if free_pages is None else free_pages
    return requests, _plan(0, [(r, r.prompt, True) for r in requests], page_size, free)


def test_kv_capacity_from_memory_budget():
    import torch

    per_token = kv_bytes_per_token(30, 3, 64, torch.float32)
    assert per_token == 2 * 30 * 3 * 64 * 4
    pages = num_pages_for(16, memory_gb=1.0, bytes_per_token=per_token)
    assert (pages - 1) * 16 * per_token <= GIB < (pages + 1) * 16 * per_token
    assert num_pages_for(16, capacity_tokens=33) == 4  # 3 usable pages + the dummy page


def test_capacity_excludes_dummy_page(runner):
    assert runner.kv_capacity_tokens == 256
    assert runner.kv_cache.num_pages == 256 // 4 + 1


def test_page_table_updates_are_applied(runner):
    _, batch = _prefill([[5, 6, 7, 8, 9]], runner.page_size, slots=[2])
    runner.execute(batch)
    cols = batch.page_table_cols.tolist()
    assert runner.kv_cache.page_table[2, cols].tolist() == batch.page_table_pages.tolist()


@pytest.mark.parametrize("corrupt, message", [
    (lambda b: setattr(b, "kv_locs", b.kv_locs[:-1]), "disagree"),
    (lambda b: b.kv_locs.__setitem__(0, 10 ** 6), "kv_locs out of range"),
    (lambda b: b.input_ids.__setitem__(0, 10 ** 6), "token id out of range"),
    (lambda b: setattr(b, "slots", [9]), "slot out of range"),
    (lambda b: setattr(b, "samples", []), "differ in length"),
    (lambda b: setattr(b, "page_table_pages", np.asarray([10 ** 6], dtype=np.int32)), "page out of range"),
    (lambda b: b.positions.__setitem__(0, 64), "position out of range"),
])
def test_malformed_batch_is_rejected(runner, corrupt, message, monkeypatch):
    monkeypatch.setattr(model_runner, "DEBUG_CHECKS", True)  # the per-step checks run only when debugging
    _, batch = _prefill([[5, 6, 7]], runner.page_size)
    corrupt(batch)
    with pytest.raises(ValueError, match=message):
        runner.execute(batch)


def test_intermediate_chunk_returns_no_tokens(runner):
    requests, batch = _prefill([[5, 6, 7]], runner.page_size)
    batch.samples = [False]
    result = runner.execute(batch)
    assert result.step == batch.step and result.next_token_ids.shape == (0,)


def test_seeded_sampling_is_independent_of_the_batch(runner):
    """A seeded request samples the same tokens alone and beside others (sample_counts advance it)."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)

    def run(prompts, params):
        return _generate(runner, prompts, params, steps=6)

    alone = run([[11, 12, 13, 14]], [seeded])[0]
    together = run([[20, 21], [11, 12, 13, 14], [30, 31, 32]], [GREEDY, seeded, SamplingParams(temperature=1.0)])[1]
    assert alone == together


def _generate(runner, prompts, params, steps):
    """Like generate_greedy, with per-request sampling params (one packed prefill, then decodes)."""
    free = list(range(runner.kv_cache.num_pages - 1, 0, -1))
    requests, batch = _prefill(prompts, runner.page_size, free_pages=free)
    batch.sampling = list(params)
    outputs = [[t] for t in runner.execute(batch).next_token_ids.tolist()]
    for r in requests:
        r.fed = len(r.prompt)
    for step in range(1, steps):
        rows = [(r, [out[-1]], True) for r, out in zip(requests, outputs)]
        batch = _plan(step, rows, runner.page_size, free)
        batch.sampling = list(params)
        batch.sample_counts = [len(out) for out in outputs]
        for out, token in zip(outputs, runner.execute(batch).next_token_ids.tolist()):
            out.append(token)
        for r in requests:
            r.fed += 1
    return outputs


def test_greedy_unaffected_by_stale_slots_and_pages(tiny_model_dir):
    """Slots and pages recycled from finished requests (stale page-table rows) change nothing."""
    runner = ModelRunner(tiny_model_dir("qwen3"), device="cpu", page_size=2, kv_capacity_tokens=96,
                         max_running_requests=2)
    prompts = [[7, 8, 9, 10, 11, 12, 13], [40, 41], [50, 51, 52, 53, 54]]
    first = generate_greedy(runner, prompts[:2], 12)
    again = generate_greedy(runner, prompts[:2], 12)
    assert first == again
    solo = generate_greedy(runner, prompts[2:], 12)
    assert generate_greedy(runner, prompts[2:], 12, chunk=3) == solo
