"""The prefix cache through the `openai` client, as users call it: a second chat with the same
system prompt reports it as `prompt_tokens_details.cached_tokens` (streamed and not), answers exactly
as without the cache, /metrics counts the hits, and a disconnect storm leaves no page referenced."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from e2e_server import metric, start_server, wait_until

SYSTEM = " ".join(f"w{3 + i % 300}" for i in range(300))  # a 300-token system prompt


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("prefix-cache")
    cached = start_server(model, logs / "cached.log", "--kv-capacity-tokens", "8192")
    plain = start_server(model, logs / "plain.log", "--kv-capacity-tokens", "8192", "--disable-prefix-cache")
    yield cached, plain
    cached.stop()
    plain.stop()


def _chat(url: str, model: str, question: str, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=12,
        temperature=0,
        **kw,
    )


def test_the_second_chat_with_a_system_prompt_is_mostly_cached(servers, model):
    cached, plain = servers
    first = _chat(cached.url, str(model), "w7 w8")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = _chat(cached.url, str(model), "w9")
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * 300
    assert second.choices[0].message.content == _chat(plain.url, str(model), "w9").choices[0].message.content

    stream = _chat(cached.url, str(model), "w10 w11", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * 300 and usage.prompt_tokens > 300
    assert metric(cached.url, "batchserve_prefix_cache_hit_tokens_total") >= 2 * 0.9 * 300
    assert metric(cached.url, "batchserve_prefix_cache_queried_tokens_total") >= 3 * 300
    assert metric(cached.url, "batchserve_prefix_cache_pages") > 0
    assert metric(plain.url, "batchserve_prefix_cache_hit_tokens_total") == 0
    # the plain server never counts anything, and reports every prompt token as computed
    assert _chat(plain.url, str(model), "w9").usage.prompt_tokens_details.cached_tokens == 0


def test_a_disconnect_storm_leaves_no_referenced_page(servers, model):
    cached, _ = servers
    body = {
        "model": str(model),
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w5"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }

    async def storm():
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> None:
                async with session.post(f"{cached.url}/v1/chat/completions", json=body) as resp:
                    n = 0
                    async for _ in resp.content:
                        n += 1
                        if n > i % 5:
                            break
                    resp.close()

            await asyncio.gather(*(one(i) for i in range(30)))

    asyncio.run(storm())
    assert wait_until(
        lambda: (
            metric(cached.url, "batchserve_prefix_cache_referenced_pages") == 0
            and metric(cached.url, "batchserve_kv_cache_used_tokens") == 0
            and metric(cached.url, "batchserve_num_requests_running") == 0
        ),
        timeout=30,
    )
    assert metric(cached.url, "batchserve_prefix_cache_pages") > 0  # what was computed stays cached
