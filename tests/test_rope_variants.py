"""Rope variants on tiny random models built from transformers configs with an original context of 32
positions and prompts and outputs that cross it: yarn (with and without mscale, truncate), longrope
(Phi-3's short and long factors), partial rotary (Phi-4-mini's 0.75), and Phi3ForCausalLM's fused
checkpoints. Frequencies and attention factors equal transformers' own; greedy tokens equal
transformers' `generate` at batch 1 however the batch is cut, with and without the C kernels; through the
scheduler too, where a request that grows past longrope's original context is recomputed with the long
factors (transformers' Phi-3 drops its cache there), with prefix-cache hits and preemption, longrope's
regime being part of the cache key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_batches import generate_greedy
from model_references import greedy_references, small_runner, torch_only
from test_model_equivalence import SCHEDULES, transformers_greedy_text

from batchserve.kernels.rope import RotaryTables, attention_factor, inv_freq
from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.model import ModelLoadError
from batchserve.shared.rope import RopeConfig

ORIGINAL = 32  # the original context every model here extends
NEW_TOKENS = 24
PROMPT_LENS = (20, 40, 9, 33, 31)  # short ones whose outputs cross 32, long ones past it from the start
# Without the scheduler, nothing recomputes a sequence that grows past longrope's switch: prompts whose
# outputs stay short of it, and prompts past it (the crossing ones run through the scheduler below).
LONGROPE_PROMPT_LENS = (9, 40, 5, 33, 2)


def _factors(n: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    return [round(1.0 + 3.0 * float(x), 4) for x in torch.rand(n, generator=generator)]


def _longrope(pairs: int) -> dict:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": _factors(pairs, 1),
        "long_factor": _factors(pairs, 2),
    }


EXTENDED = dict(max_position_embeddings=128)
MODELS = {
    "phi3-longrope": dict(
        arch="phi3", original_max_position_embeddings=ORIGINAL, rope_parameters=_longrope(8), **EXTENDED
    ),
    "phi3-longrope-partial": dict(
        arch="phi3",
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75,
        rope_parameters={**_longrope(6), "partial_rotary_factor": 0.75},
        **EXTENDED,
    ),
    "phi3-partial": dict(
        arch="phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    ),
    "llama-yarn": dict(
        arch="llama",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        **EXTENDED,
    ),
    "qwen3-yarn-mscale": dict(
        arch="qwen3",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
            "beta_fast": 8.0,
            "beta_slow": 2.0,
        },
        **EXTENDED,
    ),
}


def _prompts(model: str = "") -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lens = LONGROPE_PROMPT_LENS if "longrope" in model else PROMPT_LENS
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in lens]


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(tiny_model_dir, MODELS, _prompts, NEW_TOKENS)


@pytest.mark.parametrize("model", list(MODELS))
def test_frequencies_and_attention_factor_are_transformers(tiny_model_dir, model):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_dir = tiny_model_dir(**MODELS[model])
    hf = AutoConfig.from_pretrained(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    ours = RopeConfig.from_hf(raw, "config.json")
    head_dim = hf.hidden_size // hf.num_attention_heads if model.startswith(("phi3", "llama")) else hf.head_dim
    for long in (False, True):
        if ours.kind == "default":  # transformers' models compute it themselves
            from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

            expected, factor = Phi3RotaryEmbedding.compute_default_rope_parameters(hf, "cpu")
        else:
            expected, factor = ROPE_INIT_FUNCTIONS[ours.kind](hf, "cpu", seq_len=ORIGINAL + 1 if long else None)
        assert torch.equal(inv_freq(ours, head_dim, long=long), expected)
        assert attention_factor(ours) == factor
    assert ours.rotary_dim(head_dim) == 2 * inv_freq(ours, head_dim).shape[0]
    assert ours.switch_length == (ORIGINAL if ours.kind == "longrope" else 0)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(references, model, schedule):
    model_dir, expected = references(model)
    assert generate_greedy(small_runner(model_dir), _prompts(model), NEW_TOKENS, **SCHEDULES[schedule]) == expected


@pytest.mark.parametrize("model", ["phi3-longrope", "phi3-longrope-partial", "llama-yarn"])
def test_torch_only_path_matches_transformers(references, model, monkeypatch):
    model_dir, expected = references(model)
    with torch_only(monkeypatch):
        assert generate_greedy(small_runner(model_dir), _prompts(model), NEW_TOKENS, **SCHEDULES["mixed"]) == expected


def test_longrope_regime_follows_the_prompt_and_the_position(tiny_model_dir):
    """The long factors for every token of a prompt longer than the original context and for any token
    past it; the short ones otherwise, whatever chunk the token comes in."""
    runner = small_runner(tiny_model_dir(**MODELS["phi3-longrope"]))
    tables: RotaryTables = runner.model.rope
    positions = np.asarray([0, 31, 32, 0, 31, 32], dtype=np.int32)
    prompt_lens = np.asarray([32, 32, 32, 33, 33, 33])
    assert tables.rows(positions, prompt_lens).tolist() == [0, 31, 128 + 32, 128, 128 + 31, 128 + 32]
    assert runner.worker_info().rope_switch_length == ORIGINAL
    assert small_runner(tiny_model_dir(**MODELS["llama-yarn"])).worker_info().rope_switch_length == 0


# ------------------------------------------------------------------ through the scheduler


def _words(n: int, first: int) -> str:
    return " ".join(f"w{first + i}" for i in range(n))


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model_dir = tiny_model_dir(with_tokenizer=True, **MODELS["phi3-longrope-partial"])
    long_prompt = _words(40, 10)  # past the original context: every key long
    prompts = [long_prompt, _words(20, 10), _words(36, 10), _words(31, 100), _words(32, 200), _words(9, 10)]
    return model_dir, prompts, transformers_greedy_text(model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("policy, budget", [("prefill-first", 64), ("mixed", 8), ("fixed", 16)])
def test_requests_growing_past_the_switch_are_recomputed_as_transformers_does(served, policy, budget):
    """Outputs that cross the original context (a 20- and a 31-token prompt, a 32-token one at its first
    decode) equal transformers': recomputed once with the long factors; chunks smaller than the switch."""
    model_dir, prompts, expected = served
    engine = OfflineEngine(_config(model_dir, page_size=4, policy=policy, prefill_budget=budget))
    assert _generate(engine, prompts) == expected
    assert engine.preemptions == 3  # the three crossing requests, once each
    assert engine.scheduler.kv_used_tokens == 0


def _generate(engine: OfflineEngine, prompts: list[str], first: int = 0) -> list[list[int]]:
    requests = [
        request(
            f"r{first + i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": NEW_TOKENS, "ignore_eos": True}
        )
        for i, p in enumerate(prompts)
    ]
    return [c.token_ids for c in engine.generate(requests)]


def test_prefix_cache_keeps_the_regimes_apart(served):
    """The long prompt's pages are cached; a short prompt with the same first 8 tokens (its outputs stay
    short of the switch) must not reuse them (their keys have the long factors); a longer one does."""
    model_dir, prompts, expected = served
    engine = OfflineEngine(_config(model_dir, page_size=4))
    assert _generate(engine, prompts[:1]) == expected[:1]
    kv = engine.scheduler.kv
    assert _generate(engine, prompts[5:], 1) == expected[5:]
    assert kv.hit_tokens == 0
    assert _generate(engine, prompts[2:3], 2) == expected[2:3]
    assert kv.hit_tokens >= 32  # 36 tokens: the long prompt's first 8 pages
    assert engine.scheduler.kv_used_tokens == 0 and kv.cache.num_referenced == 0


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_preempted_requests_keep_their_regime(served, prefix_cache):
    """Recomputed from prompt + generated tokens (a prompt past the original context now), a short
    request's keys keep the short factors before the switch: the same tokens as alone."""
    model_dir, prompts, expected = served
    engine = OfflineEngine(
        _config(
            model_dir,
            page_size=4,
            kv_capacity_tokens=96,
            kv_reserve_ratio=0.05,
            max_running_requests=4,
            prefill_budget=16,
            disable_prefix_cache=not prefix_cache,
        )
    )
    assert _generate(engine, prompts) == expected
    assert engine.preemptions > 0


def _config(model_dir, **fields):
    from batchserve.shared.config import ServerConfig

    base = dict(kv_capacity_tokens=2048, max_running_requests=4, prefill_budget=64)
    return ServerConfig(model=str(model_dir), **{**base, **fields})


# ------------------------------------------------------------------ refusals


def test_unsupported_or_malformed_rope_is_refused_naming_it(tiny_model_dir, tmp_path):
    raw = {"rope_parameters": {"rope_type": "ntk-by-parts", "factor": 2.0}}
    with pytest.raises(ValueError, match="unsupported rope scaling type 'ntk-by-parts' in here.json"):
        RopeConfig.from_hf(raw, "here.json")
    with pytest.raises(ValueError, match="rope scaling 'longrope' in here.json: missing or malformed field"):
        RopeConfig.from_hf({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "here.json")
    short = RopeConfig.from_hf({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "x")
    with pytest.raises(ValueError, match="short_factor has 1 entries, expected rotary_dim / 2 = 8"):
        inv_freq(short, 16)


def test_phi3_checkpoint_problems_are_refused(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model_dir(arch="phi3")
    model_dir = tmp_path / "phi3"
    shutil.copytree(source, model_dir)
    (weights_file,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights_file)
    tensors["model.layers.0.self_attn.qkv_proj.weight"] = tensors["model.layers.0.self_attn.qkv_proj.weight"][:-16]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.0.self_attn.qkv_proj.weight has 112 rows, expected 128"):
        small_runner(model_dir)


def test_draft_rows_end_before_the_switch():
    """A short request's speculative row stops at the last position before the switch (the request is
    recomputed there); a long one's is not held back."""
    from test_scheduler_sliding_window import WindowExecutor

    from batchserve.procs.scheduler import Scheduler, SchedulerConfig
    from batchserve.shared.messages import RequestParams, StopParams

    config = SchedulerConfig(
        max_running_requests=2, prefill_budget=32, kv_capacity_tokens=128, rope_switch_length=8, speculative="ngram"
    )
    sched = Scheduler(config, eos_token_ids=(2,))
    prompts = {"short": list(range(3, 9)), "long": list(range(20, 30))}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, RequestParams(stop=StopParams(max_tokens=20, ignore_eos=True)))
    sched.step(WindowExecutor(sched, prompts, 10**9))  # both prompts in: KV 6 and 10
    room = {rid: sched.planner.draft_room(sched.requests[rid].slot) for rid in prompts}
    assert room == {"short": 8 - 1 - 6, "long": 20 - 1 - 2}
