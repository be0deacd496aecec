"""The prefix cache for real (scheduler + worker in one process, tiny random models): requests that
start with a prompt prefix computed before skip it, and their greedy tokens are exactly those of the
same requests without the cache; on each CPU attention backend, with 1- and 16-token pages, for a
page-aligned prefix and one that ends inside a page."""

from __future__ import annotations

import pytest

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig

NEW_TOKENS = 16


def _prompts(prefix_words: int) -> list[str]:
    system = " ".join(f"w{3 + i}" for i in range(prefix_words))
    return [f"{system} w200 w201", f"{system} w210", f"{system} w220 w221 w222", f"{system} w200 w201"]


def _run(model_dir, prompts: list[str], **fields) -> tuple[list[list[int]], OfflineEngine]:
    engine = OfflineEngine(
        ServerConfig(model=str(model_dir), kv_capacity_tokens=2048, max_running_requests=4, prefill_budget=64, **fields)
    )
    greedy = {"temperature": 0}
    stop = {"max_tokens": NEW_TOKENS, "ignore_eos": True}
    first = engine.generate([request("first", prompt=prompts[0], sampling=greedy, stop=stop)])  # fills the cache
    rest = engine.generate([request(f"r{i}", prompt=p, sampling=greedy, stop=stop) for i, p in enumerate(prompts[1:])])
    return [c.token_ids for c in first + rest], engine


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefix_words", [16, 21], ids=["page-aligned", "past-a-page"])
def test_greedy_output_is_the_same_with_the_cache(tiny_model_dir, backend, page_size, prefix_words):
    model_dir = tiny_model_dir("llama", with_tokenizer=True, seed=11)
    prompts = _prompts(prefix_words)
    plain, _ = _run(model_dir, prompts, page_size=page_size, attention_backend=backend, disable_prefix_cache=True)
    cached, engine = _run(model_dir, prompts, page_size=page_size, attention_backend=backend)
    assert cached == plain
    kv = engine.scheduler.kv
    reused = prefix_words // page_size * page_size  # the full pages of the shared prefix
    if page_size == 1:
        reused = prefix_words + 1  # the repeated prompt also finds its own last-but-one token
    assert kv.hit_tokens >= 2 * (prefix_words // page_size * page_size) + reused
    assert engine.scheduler.kv_used_tokens == 0 and kv.cache.num_referenced == 0


def test_concurrent_requests_with_one_prefix_share_its_pages(tiny_model_dir):
    """Admitted one step apart (a small budget keeps the first one chunking): the second starts on the
    pages the first has already finished."""
    model_dir = tiny_model_dir("llama", with_tokenizer=True, seed=11)
    prompts = _prompts(40)
    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            kv_capacity_tokens=2048,
            max_running_requests=4,
            prefill_budget=24,
            page_size=4,
            policy="mixed",
        )
    )
    greedy, stop = {"temperature": 0}, {"max_tokens": NEW_TOKENS, "ignore_eos": True}
    together = engine.generate([request(f"c{i}", prompt=p, sampling=greedy, stop=stop) for i, p in enumerate(prompts)])
    plain = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            kv_capacity_tokens=2048,
            max_running_requests=4,
            prefill_budget=24,
            page_size=4,
            policy="mixed",
            disable_prefix_cache=True,
        )
    )
    assert [c.token_ids for c in together] == [
        c.token_ids
        for c in plain.generate([request(f"c{i}", prompt=p, sampling=greedy, stop=stop) for i, p in enumerate(prompts)])
    ]
    assert engine.scheduler.kv.hit_tokens > 0
