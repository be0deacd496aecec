"""What works for dense models works for mixtures of experts: the scheduler and the worker in one process
(`OfflineEngine`) on a tiny Qwen3-MoE (q/k norms, 8 experts, top 2) and a tiny Qwen2-MoE (shared expert):
transformers' greedy tokens under every policy; the prefix cache skips a shared prefix and changes no token;
preempted requests are recomputed to the same tokens; n-gram and draft-model speculation leave greedy
output as it is while drafts are accepted; structured output holds; logprobs and prompt logprobs agree
with the model's; `batchserve generate` and `bench_engine` run it; int8 weights cover the experts."""

from __future__ import annotations

import json
import math

import pytest
from test_model_equivalence import transformers_greedy_text

from batchserve.procs.cli import main as cli_main
from batchserve.procs.engine import OfflineEngine
from batchserve.procs.engine import request as make_request
from batchserve.shared.config import ServerConfig

PROMPTS = [
    "the quick brown fox",
    "Ada",
    '{"name": "Ada", "age": 36}',
    "jumps over the lazy dog the quick brown",
    "the lazy dog the lazy dog the lazy",
]
NEW_TOKENS = 16
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def model(request, tiny_model_dir):
    model_dir = tiny_model_dir(
        request.param, with_tokenizer="bytes", seed=7, norm_topk_prob=request.param == "qwen3_moe"
    )
    return model_dir, transformers_greedy_text(model_dir, PROMPTS, NEW_TOKENS)


def engine(model_dir, **fields) -> OfflineEngine:
    config = dict(model=str(model_dir), page_size=4, kv_capacity_tokens=2048, prefill_budget=16, max_running_requests=4)
    return OfflineEngine(ServerConfig(**{**config, **fields}))


def greedy(n: int = NEW_TOKENS, **fields) -> list:
    return [
        make_request(f"r{i}", prompt=p, sampling=GREEDY, stop={"max_tokens": n, "ignore_eos": True}, **fields)
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("policy", ["prefill-first", "mixed", "fixed"])
def test_greedy_tokens_are_transformers_under_every_policy(model, policy):
    model_dir, reference = model
    assert [c.token_ids for c in engine(model_dir, policy=policy).generate(greedy())] == reference


def test_the_prefix_cache_skips_the_prefix_and_changes_no_token(model):
    model_dir, reference = model
    eng = engine(model_dir)
    assert [c.token_ids for c in eng.generate(greedy())] == reference
    hits = eng.scheduler.kv.hit_tokens
    assert [c.token_ids for c in eng.generate(greedy())] == reference  # the prompts again: from the cache
    assert eng.scheduler.kv.hit_tokens > hits


def test_preempted_requests_are_recomputed_to_the_same_tokens(model):
    model_dir, reference = model
    eng = engine(model_dir, kv_capacity_tokens=64, max_running_requests=5, kv_reserve_ratio=0.05)
    assert [c.token_ids for c in eng.generate(greedy())] == reference
    assert eng.preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_greedy_output_and_accepts_drafts(model, method):
    model_dir, _ = model
    fields = dict(speculative=method, num_speculative_tokens=3, ngram_min=1)
    if method == "draft":
        fields["draft_model"] = str(model_dir)  # itself: it agrees, so most drafts are accepted
    plain = engine(model_dir).generate(greedy(32))
    spec_engine = engine(model_dir, **fields)
    spec = spec_engine.generate(greedy(32))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert spec_engine.accepted_tokens > 0


def test_structured_output_holds(model):
    model_dir, _ = model
    schema = {
        "type": "object",
        "required": ["name", "age"],
        "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    }
    reqs = [
        make_request(
            f"j{seed}",
            prompt=PROMPTS[0],
            sampling={"temperature": 1.0, "seed": seed},
            stop={"max_tokens": 48},
            constraint={"kind": "json_schema", "spec": json.dumps(schema)},
        )
        for seed in range(4)
    ]
    done = engine(model_dir).generate(reqs)
    assert any(c.finish_reason == "stop" for c in done)
    for completion in done:
        if completion.finish_reason == "stop":
            value = json.loads(completion.text)
            assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_logprobs_and_prompt_logprobs_are_the_models(model):
    model_dir, reference = model
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = engine(model_dir).generate(greedy(logits={"logprobs": 2, "prompt_logprobs": 1}))
    assert [c.token_ids for c in done] == reference
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPTS[0])
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(torch.tensor([ids + reference[0]])).logits[0].float(), dim=-1)
    first = done[0]
    for i, token in enumerate(first.token_ids):  # each generated token is the top one, with the model's logprob
        assert first.logprobs[i].top_ids[0] == first.logprobs[i].token_id == token
        assert math.isclose(first.logprobs[i].logprob, float(logprobs[len(ids) - 1 + i, token]), abs_tol=1e-4)
    for i, entry in enumerate(first.prompt_logprobs, 1):
        assert math.isclose(entry.logprob, float(logprobs[i - 1, ids[i]]), abs_tol=1e-4)


def test_int8_weights_cover_the_experts(model):
    import torch

    from batchserve.kernels.panel_linear import StackedPanels
    from batchserve.procs.worker.models.moe import SparseMoeBlock

    model_dir, reference = model
    eng = engine(model_dir, quantization="int8")
    block = next(layer.mlp for layer in eng.runner.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert isinstance(block.experts.gate_up, StackedPanels) and block.experts.gate_up.packed.dtype == torch.int8
    assert block.experts.gate_up.scale is not None and block.native is not None
    tokens = [c.token_ids for c in eng.generate(greedy())]
    assert sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r)) >= 0.5 * len(PROMPTS) * NEW_TOKENS


def test_batchserve_generate_runs_it(model, capsys):
    model_dir, reference = model
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                PROMPTS[0],
                "--max-tokens",
                str(NEW_TOKENS),
                "--temperature",
                "0",
                "--ignore-eos",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == reference[0]


def test_bench_engine_runs_it(model, capsys):
    from batchserve.loadtests import bench_engine

    model_dir, _ = model
    assert (
        bench_engine.main(
            [
                "--model",
                str(model_dir),
                "--only-decode",
                "--batch-sizes",
                "1,4",
                "--decode-steps",
                "4",
                "--repeats",
                "1",
                "--prompt-len",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "decode tokens/s" in out and " 4/4" in out  # the same tokens as transformers on every row
