"""Sliding-window attention on tiny random models built from transformers configs, windows of 8-12 tokens
and prompts and outputs that cross them: every layer sliding (Mistral, Mixtral, Phi-3, Qwen3-MoE) and
sliding layers beside full ones (`layer_types`: Qwen2, Qwen2-MoE). Greedy tokens equal transformers'
`generate` at batch 1 however the batch is cut (chunks shorter than the window), with and without the C
kernels; every position's logits (what prompt logprobs are made of) within 1e-4 of transformers' over
chunked prompts; through the scheduler, whose all-sliding requests give back the pages behind their
window as they go (SCHEDULING.md 5), with preemption and n-gram speculative rows; a mixed model's sliding
layers in rings (the default), or keeping every position with the prefix cache's hits."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy
from model_references import assert_chunked_logits_close, greedy_references, small_runner, torch_only
from test_model_equivalence import SCHEDULES, transformers_greedy_text

from batchserve.procs.engine import OfflineEngine, request
from batchserve.procs.worker.loader import load_model_config
from batchserve.shared.config import ServerConfig
from batchserve.shared.model import ModelLoadError, ModelSpec

NEW_TOKENS = 20
PROMPT_LENS = (30, 5, 13, 9, 21)
MODELS = {
    "mistral": (dict(arch="mistral", sliding_window=8), (8, 8)),
    "mixtral": (dict(arch="mixtral", sliding_window=10), (10, 10)),
    "phi3": (dict(arch="phi3", sliding_window=9), (9, 9)),
    "qwen3_moe": (dict(arch="qwen3_moe", use_sliding_window=True, sliding_window=12, norm_topk_prob=True), (12, 12)),
    "qwen2-layer-types": (dict(arch="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1), (0, 8)),
    "qwen2_moe-layer-types": (
        dict(arch="qwen2_moe", use_sliding_window=True, sliding_window=8, max_window_layers=2),
        (8, 0),
    ),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(
        tiny_model_dir, {name: overrides for name, (overrides, _) in MODELS.items()}, lambda _: _prompts(), NEW_TOKENS
    )


@pytest.mark.parametrize("model", list(MODELS))
def test_windows_are_read_as_transformers_reads_them(tiny_model_dir, model):
    overrides, windows = MODELS[model]
    assert load_model_config(ModelSpec.resolve(tiny_model_dir(**overrides))).windows == windows


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(references, model, schedule):
    model_dir, expected = references(model)
    runner = small_runner(model_dir)
    assert runner.attention.windows == MODELS[model][1]
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", ["qwen2-layer-types", "qwen2_moe-layer-types"])
def test_sliding_layers_in_rings_match_transformers(references, model, schedule):
    """A mixed model's sliding layer in rings of 20 tokens, which the 50-token requests wrap; the C kernels'
    fused decode call (one page table for every layer) steps aside."""
    model_dir, expected = references(model)
    runner = small_runner(model_dir, rings=True)
    assert runner.kv_cache.ring_layers == (MODELS[model][1].index(8),)
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES[schedule]) == expected


@pytest.mark.parametrize("model", ["mistral", "qwen2-layer-types"])
def test_torch_only_path_matches_transformers(references, model, monkeypatch):
    model_dir, expected = references(model)
    with torch_only(monkeypatch):
        runner = small_runner(model_dir)
        assert runner.attention.name == "torch" and not runner.model.fuse_decode_layers
        assert generate_greedy(runner, _prompts(), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


@pytest.mark.parametrize("model", ["mistral", "qwen2-layer-types"])
def test_every_position_logits_close_over_chunks(tiny_model_dir, model):
    """A 30-token prompt in chunks of 5: every position's logits (prompt logprobs' input) are transformers'."""
    assert_chunked_logits_close(tiny_model_dir(**MODELS[model][0]), _prompts()[0])


# ------------------------------------------------------------------ through the scheduler


def _words(n: int, first: int) -> str:
    return " ".join(f"w{first + i}" for i in range(n))


GEMMA2_MIXED = dict(arch="gemma2", head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
SERVED = {  # all layers sliding; sliding beside full (the word tokenizer needs a non-Qwen model type), in rings
    "mistral": (MODELS["mistral"][0], {}),  # or keeping every position
    "gemma2-rings": (GEMMA2_MIXED, {}),
    "gemma2-full": (GEMMA2_MIXED, {"full_sliding_kv": True}),
}


@pytest.fixture(scope="module", params=list(SERVED))
def served(tiny_model_dir, request):
    overrides, settings = SERVED[request.param]
    model_dir = tiny_model_dir(with_tokenizer=True, **overrides)
    prompts = [_words(24, 10), _words(24, 10) + " w200 w201", _words(3, 40), _words(17, 100), _words(12, 10)]
    return model_dir, prompts, transformers_greedy_text(model_dir, prompts, NEW_TOKENS), settings


def _generate(engine: OfflineEngine, prompts: list[str]) -> list[list[int]]:
    return [
        c.token_ids
        for c in engine.generate(
            [
                request(
                    f"r{i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": NEW_TOKENS, "ignore_eos": True}
                )
                for i, p in enumerate(prompts)
            ]
        )
    ]


@pytest.mark.parametrize(
    "fields",
    [
        dict(prefill_budget=6, policy="mixed"),  # chunks shorter than the window
        dict(kv_capacity_tokens=48, kv_reserve_ratio=0.05, prefill_budget=16),  # preemption and recompute
        dict(speculative="ngram", num_speculative_tokens=3),  # decode rows several tokens wide
    ],
    ids=["chunked", "preempted", "ngram"],
)
def test_scheduled_requests_match_transformers(served, fields):
    model_dir, prompts, expected, settings = served
    config = ServerConfig(
        model=str(model_dir),
        page_size=4,
        max_running_requests=5,
        **{"kv_capacity_tokens": 2048, "prefill_budget": 64, **settings, **fields},
    )
    engine = OfflineEngine(config)
    kv = engine.scheduler.kv
    dropped = []
    drop = kv.drop_out_of_window
    kv.drop_out_of_window = lambda: dropped.append(drop()) or dropped[-1]
    first = _generate(engine, prompts[:1])  # a mixed model caches its pages: the second prompt starts on them
    assert first + _generate(engine, prompts[1:]) == expected
    if kv.window:  # every layer slides: pages behind the window go back, and no prefix is cached
        assert kv.cache is None and sum(dropped) > 0
    elif engine.runner.kv_cache.ring_layers:  # the sliding layers in rings: no prefix cache either
        assert kv.cache is None and sum(dropped) == 0 and "full_sliding_kv" not in settings
    else:
        assert kv.hit_tokens >= 24 - 4 and sum(dropped) == 0
    if "kv_reserve_ratio" in fields and not kv.window:  # a window's pages fit here (test_scheduler_sliding_window
        assert engine.preemptions > 0  # preempts windowed requests)


def test_windows_without_layers_are_refused(tiny_model_dir, tmp_path):
    import json
    import shutil

    model_dir = tmp_path / "qwen2"
    shutil.copytree(tiny_model_dir("qwen2"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8)
    config.pop("layer_types")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="use_sliding_window without layer_types"):
        load_model_config(ModelSpec.resolve(model_dir))
    (model_dir / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention", "local"]}))
    with pytest.raises(ModelLoadError, match="layer_types in .*: 2 of 'sliding_attention' or 'full_attention'"):
        load_model_config(ModelSpec.resolve(model_dir))
