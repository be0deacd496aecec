"""End to end on a tiny mixture of experts (Qwen3-MoE: q/k norms, 8 experts, top 2): `batchserve serve`
(five real processes) called through the `openai` package as users do. Greedy output is token for token
transformers' (streamed and not, chat too); `n` choices, logprobs and sampled streams work as for a dense
model; `/metrics` shows the experts' load as one imbalance histogram."""

from __future__ import annotations

import pytest
from e2e_server import metric, start_server, wait_until
from openai import OpenAI
from test_model_equivalence import transformers_greedy

MAX_TOKENS = 12
PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], [42], list(range(3, 40))]
SPECIAL = {0, 1, 2}


def words_to_ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3_moe", with_tokenizer=True, seed=3, norm_topk_prob=True)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server(model, tmp_path_factory.mktemp("e2e-moe") / "serve.log", "--kv-capacity-tokens", "4096")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_output_is_transformers_streamed_or_not(client, model):
    expected = transformers_greedy(model, PROMPTS, MAX_TOKENS)
    for prompt, tokens in zip(PROMPTS, expected):
        visible = [t for t in tokens if t not in SPECIAL]
        done = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert words_to_ids(done.choices[0].text) == visible
        chunks = client.completions.create(
            model=str(model),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert words_to_ids("".join(c.choices[0].text for c in chunks if c.choices)) == visible


def test_chat_n_choices_and_logprobs(client, model):
    chat = client.chat.completions.create(
        model=str(model),
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        n=3,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert len(chat.choices) == 3 and chat.usage.completion_tokens == 3 * MAX_TOKENS
    for choice in chat.choices:
        entries = choice.logprobs.content
        assert len(entries) == MAX_TOKENS
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)
    streamed = client.chat.completions.create(
        model=str(model),
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        n=2,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(len(words_to_ids(t)) == MAX_TOKENS for t in texts.values())


def test_metrics_show_the_expert_load(server, client, model):
    def routed() -> bool:  # the worker sends its counts with a step's result about once a second
        client.completions.create(model=str(model), prompt=list(range(3, 60)), max_tokens=4, temperature=0)
        return metric(server.url, "batchserve_moe_routed_tokens_total") > 0

    assert wait_until(routed, timeout=30, interval=0.5)
    assert metric(server.url, "batchserve_moe_expert_load_imbalance_count") > 0
    assert 1.0 <= metric(server.url, "batchserve_moe_max_expert_load_imbalance") <= 8 / 2
