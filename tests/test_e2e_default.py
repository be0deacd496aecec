"""End to end on the default model (SmolLM2-135M-Instruct): a few checks that the real model served
by the five processes answers exactly as the offline engine does (greedy)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from e2e_server import http, reference_greedy, start_server, stream

from batchserve.shared.config import DEFAULT_MODEL

pytestmark = pytest.mark.slow

CONFIG = {"kv_capacity_tokens": 8192, "max_running_requests": 8}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        DEFAULT_MODEL,
        tmp_path_factory.mktemp("e2e-default") / "serve.log",
        "--kv-capacity-tokens",
        str(CONFIG["kv_capacity_tokens"]),
        "--max-running-requests",
        str(CONFIG["max_running_requests"]),
        startup_timeout=600,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from batchserve.shared.model import load_tokenizer

    return load_tokenizer(DEFAULT_MODEL)


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def expected(tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    tokens = reference_greedy(DEFAULT_MODEL, ids, MAX_TOKENS, **CONFIG)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens], tokens


def test_greedy_completions_match_the_offline_engine(server, expected):
    texts, tokens = expected
    for prompt, text, ids in zip(PROMPTS, texts, tokens):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        status, out = http(f"{server.url}/v1/completions", body)
        assert status == 200, out
        assert out["choices"][0]["text"] == text
        assert out["usage"]["completion_tokens"] == len(ids)
        streamed, finish, _ = stream(f"{server.url}/v1/completions", body)
        assert streamed == text and finish == out["choices"][0]["finish_reason"]


def test_concurrent_requests_match_their_solo_outputs(server, expected):
    texts, _ = expected

    async def one(session, prompt):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        async with session.post(f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            return (await resp.json())["choices"][0]["text"]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[one(session, PROMPTS[i % 2]) for i in range(4)])

    for i, text in enumerate(asyncio.run(main())):
        assert text == texts[i % 2], i


def test_chat_completion_with_the_models_template(server, tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    status, out = http(f"{server.url}/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200, out
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert out["usage"]["prompt_tokens"] == len(ids)
    expected_ids = reference_greedy(DEFAULT_MODEL, [ids], 12, **CONFIG)[0]
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(expected_ids, skip_special_tokens=True)
