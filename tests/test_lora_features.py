"""LoRA adapters beside the server's other features (issue 47, fifth part), in the offline engine on a tiny
Llama: n-gram and draft-model speculation (the draft runs the base weights; verification the adapter's, so
the greedy tokens are PEFT's), the priority queue, logprobs (the adapter's log-softmax), and structured
output (the grammar masks the adapter's logits)."""

from __future__ import annotations

import re

import pytest
import torch
from test_lora_engine import PROMPTS, engine_for, generate, setup  # noqa: F401 (setup: a module fixture)
from test_lora_worker import ADAPTERS, NEW_TOKENS, make_adapter, peft_greedy

from batchserve.procs.engine import request

JOBS = [(0, 1), (1, 2), (2, 0), (1, 1), (0, 2)]  # (prompt, adapter): both adapters and the base, mixed
NAMES = ["base", "a", "b"]
REPEATED = "w7 w8 w9 w7 w8 w9 w7 w8 w9 w7 w8"


@pytest.mark.parametrize(
    "features",
    [
        dict(speculative="ngram", ngram_min=1, num_speculative_tokens=3),
        dict(speculative="draft", num_speculative_tokens=2),  # the base model drafts for every adapter
        dict(scheduling_policy="priority"),
    ],
    ids=["ngram", "draft", "priority"],
)
def test_adapters_answer_as_peft_with_speculation_and_priorities(setup, features):  # noqa: F811
    base, folders, expected = setup
    if features.get("speculative") == "draft":
        features = {**features, "draft_model": str(base)}
    engine = engine_for(base, folders, **features)
    try:
        got = generate(engine, JOBS)
        repeated = engine.generate(
            [
                request(
                    "rep",
                    prompt=REPEATED,
                    adapter=1,
                    sampling={"temperature": 0},
                    stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
                )
            ]
        )[0].token_ids
        drafted = engine.draft_tokens
    finally:
        engine.close()
    assert got == [expected[NAMES[adapter]][p] for p, adapter in JOBS]
    if "speculative" in features:  # drafts were proposed (a prompt that repeats itself has n-gram matches)
        from transformers import AutoTokenizer

        assert drafted > 0
        assert repeated == peft_greedy(base, folders["a"], [AutoTokenizer.from_pretrained(base).encode(REPEATED)])[0]


def test_logprobs_are_the_adapters(setup):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, folders, expected = setup
    engine = engine_for(base, folders)
    try:
        completion = engine.generate(
            [
                request(
                    "r",
                    prompt=PROMPTS[0],
                    adapter=2,
                    sampling={"temperature": 0},
                    logits={"logprobs": 2},
                    stop={"max_tokens": 3, "ignore_eos": True},
                )
            ]
        )[0]
    finally:
        engine.close()
    ids = AutoTokenizer.from_pretrained(base).encode(PROMPTS[0]) + completion.token_ids
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), folders["b"])
    with torch.inference_mode():
        logits = model.eval()(torch.tensor([ids])).logits[0].log_softmax(-1)
    prompt_len = len(ids) - len(completion.token_ids)
    peft = [float(logits[prompt_len - 1 + i, token]) for i, token in enumerate(completion.token_ids)]
    assert completion.token_ids == expected["b"][0][:3]
    assert [lp.logprob for lp in completion.logprobs] == pytest.approx(peft, abs=1e-4)


def test_structured_output_masks_the_adapters_logits(tiny_model_dir, tmp_path):
    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig

    base = tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)
    folder = make_adapter(base, tmp_path / "adapter", 0, **ADAPTERS["a"])
    engine = OfflineEngine(
        ServerConfig(
            model=str(base),
            enable_lora=True,
            lora_modules=[f"a={folder}"],
            kv_capacity_tokens=2048,
            max_running_requests=4,
        )
    )
    try:
        out = engine.generate(
            [
                request(
                    f"r{adapter}",
                    prompt="fox",
                    adapter=adapter,
                    sampling={"temperature": 0},
                    stop={"max_tokens": 40},
                    constraint={"kind": "regex", "spec": "((yes|no) ){4}"},
                )
                for adapter in (1, 0)
            ]
        )
    finally:
        engine.close()
    assert all(re.fullmatch("((yes|no) ){4}", c.text) for c in out), [c.text for c in out]
