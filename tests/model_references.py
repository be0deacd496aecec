"""What the architecture tests share: a runner on a tiny model, transformers' greedy tokens cached per
model, the torch-only path (the C kernels switched off), and every position's logits over a chunked
prompt (what prompt logprobs are made of)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from model_batches import _plan, _Request
from test_model_equivalence import transformers_greedy

from batchserve.kernels import native
from batchserve.procs.worker.model_runner import ModelRunner

RING_STEP_TOKENS = 8  # the longest step after a prefix in model_batches' schedules: rings of 5 pages at a window of 8


def small_runner(
    model_dir: Path, rings: bool = False, ring_step_tokens: int = RING_STEP_TOKENS, **kwargs: Any
) -> ModelRunner:
    """A runner with pages of 4 tokens; `rings`: the sliding layers of a model that mixes them with global ones
    keep their KV in rings sized for rows of `ring_step_tokens` (which prompts and outputs wrap); `kwargs`:
    more of ModelRunner's settings."""
    return ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        page_size=4,
        kv_capacity_tokens=2048,
        max_running_requests=8,
        ring_step_tokens=ring_step_tokens if rings else 0,
        **kwargs,
    )


def run_scheduled(model_dir: Path, prompts: list[str], new_tokens: int, *, full_sliding_kv: bool):
    """(tokens of each prompt, the engine) through the scheduler: chunks of 6 (shorter than a window of 8),
    a cache hit (the first prompt runs alone, the second extends it) and preemptions (a pool of 80 tokens)."""
    from batchserve.procs.engine import OfflineEngine, request
    from batchserve.shared.config import ServerConfig

    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            page_size=4,
            max_running_requests=4,
            prefill_budget=6,
            kv_capacity_tokens=80,
            kv_reserve_ratio=0.05,
            full_sliding_kv=full_sliding_kv,
        )
    )

    def generate(ps: list[str], first: int) -> list[list[int]]:
        return [
            c.token_ids
            for c in engine.generate(
                [
                    request(
                        f"r{first + i}",
                        prompt=p,
                        sampling={"temperature": 0},
                        stop={"max_tokens": new_tokens, "ignore_eos": True},
                    )
                    for i, p in enumerate(ps)
                ]
            )
        ]

    return generate(prompts[:1], 0) + generate(prompts[1:], 1), engine


def scheduled_prompts() -> list[str]:
    def words(n: int, first: int) -> str:
        return " ".join(f"w{first + i}" for i in range(n))

    return [words(20, 10), words(20, 10) + " w200", words(3, 40), words(14, 100)]


def greedy_references(
    tiny_model_dir: Callable[..., Path],
    models: dict[str, dict],
    prompts: Callable[[str], list[list[int]]],
    new_tokens: int,
) -> Callable[[str], tuple]:
    """name -> (model folder, transformers' greedy tokens for `prompts(name)`), each built once."""
    cache: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]]]:
        if name not in cache:
            model_dir = tiny_model_dir(**models[name])
            cache[name] = (model_dir, transformers_greedy(model_dir, prompts(name), new_tokens))
        return cache[name]

    return get


@contextmanager
def torch_only(monkeypatch) -> Iterator[None]:
    """The C kernels off (torch's ops and attention backend) for what runs inside."""
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.library.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv(native.DISABLE_ENV)
        native.library.cache_clear()


def assert_chunked_logits_close(model_dir: Path, prompt: list[int], chunk: int = 5, rings: bool = False) -> None:
    """Every position's logits of `prompt` fed in chunks within 1e-4 of transformers' one pass (fp32); `rings`:
    the sliding layers in rings (`small_runner`)."""
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        expected = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            .eval()(torch.tensor([prompt]))
            .logits[0]
        )
    torch.testing.assert_close(
        chunked_logits(small_runner(model_dir, rings), prompt, chunk), expected, atol=1e-4, rtol=1e-4
    )


def chunked_logits(runner: ModelRunner, prompt: list[int], chunk: int) -> torch.Tensor:
    """Every position's float32 logits of `prompt` fed to `runner` in chunks of `chunk` (on the CPU)."""
    request, free_pages, got = _Request(prompt, 0, slot=0), list(range(runner.kv_cache.num_pages - 1, 0, -1)), []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            tokens = prompt[start : start + chunk]
            batch = _plan(start // chunk, [(request, tokens, False)], runner.page_size, free_pages)
            request.fed += len(tokens)
            runner.kv_cache.apply_page_table_updates(
                batch.page_table_slots, batch.page_table_cols, batch.page_table_pages
            )
            got.append(runner.forward_logits(batch, extra_rows=np.arange(len(tokens))).float().cpu())
    return torch.cat(got)
