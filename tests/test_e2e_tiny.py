"""End to end on a tiny random model: `batchserve serve` (five real processes) driven over HTTP.

One server for the module. Greedy outputs are checked token for token against `OfflineEngine` (the
same scheduler core and worker core in one process, no sockets); the tiny tokenizer maps token id t
to the word "w<t>", so text maps back to ids exactly.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from e2e_server import http, metric, reference_greedy, start_server, stream, wait_until

MAX_TOKENS = 12
PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], [42], [7] * 40, list(range(3, 60)), [300, 301, 302, 8]]
SPECIAL = {0, 1, 2}  # <unk> <s> </s>: not in the text


def words_to_ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def visible(tokens: list[int]) -> list[int]:
    return [t for t in tokens if t not in SPECIAL]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server(
        model,
        tmp_path_factory.mktemp("e2e") / "serve.log",
        "--kv-capacity-tokens",
        "4096",
        "--max-running-requests",
        "16",
        "--prefill-budget",
        "512",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(model):
    return reference_greedy(model, PROMPTS, MAX_TOKENS, ignore_eos=True, kv_capacity_tokens=4096)


def completion_body(model, prompt, **kw):
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def test_non_streamed_and_streamed_greedy_match_the_in_process_engine(server, model, reference):
    for prompt, expected in zip(PROMPTS, reference):
        status, body = http(f"{server.url}/v1/completions", completion_body(model, prompt))
        assert status == 200, body
        choice = body["choices"][0]
        assert words_to_ids(choice["text"]) == visible(expected), ("whole", prompt, choice["text"])
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": MAX_TOKENS,
            "total_tokens": len(prompt) + MAX_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
        }  # each prompt's first time
        text, finish, _ = stream(f"{server.url}/v1/completions", completion_body(model, prompt))
        assert words_to_ids(text) == visible(expected) and finish == "length", ("stream", prompt, text)


def test_text_prompt_and_chat_go_through_the_tokenizer(server, model):
    # "w5 w6 w7" tokenizes to [5, 6, 7]; the chat template renders "w5 w6 w7 " -> the same ids
    expected = visible(reference_greedy(model, [[5, 6, 7]], MAX_TOKENS, ignore_eos=True, kv_capacity_tokens=4096)[0])
    status, body = http(f"{server.url}/v1/completions", completion_body(model, "w5 w6 w7"))
    assert status == 200 and words_to_ids(body["choices"][0]["text"]) == expected
    chat = {
        "model": str(model),
        "messages": [{"role": "user", "content": "w5 w6 w7"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, body = http(f"{server.url}/v1/chat/completions", chat)
    assert status == 200, body
    assert words_to_ids(body["choices"][0]["message"]["content"]) == expected
    text, finish, _ = stream(f"{server.url}/v1/chat/completions", chat)
    assert words_to_ids(text) == expected and finish == "length"


async def _stream_async(session, url, body):
    text = []
    finish = None
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def test_sixteen_concurrent_streams_complete_and_match_their_solo_outputs(server, model, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                *[_stream_async(session, f"{server.url}/v1/completions", completion_body(model, p)) for p in prompts]
            )

    results = asyncio.run(main())
    for i, (text, finish) in enumerate(results):
        assert finish == "length"
        assert words_to_ids(text) == visible(reference[i % len(PROMPTS)]), i


def test_fifty_clients_disconnecting_at_random_leave_nothing_running(server, model):
    rng = random.Random(0)

    async def client(session, i):
        body = completion_body(model, PROMPTS[i % len(PROMPTS)], max_tokens=200, stream=True)
        cut_after = rng.randint(0, 6)  # chunks read before hanging up (0: right after the headers)
        async with session.post(f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            n = 0
            async for _ in resp.content:
                n += 1
                if n > cut_after:
                    break
            resp.close()  # drop the connection mid-stream

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*[client(session, i) for i in range(50)])

    asyncio.run(main())
    assert wait_until(
        lambda: (
            metric(server.url, "batchserve_num_requests_running") == 0
            and metric(server.url, "batchserve_kv_cache_used_tokens") == 0
        ),
        timeout=20,
    ), (metric(server.url, "batchserve_num_requests_running"), metric(server.url, "batchserve_kv_cache_used_tokens"))
    # and the server still answers
    status, _ = http(f"{server.url}/v1/completions", completion_body(model, [5, 6, 7]))
    assert status == 200


def test_stop_string_finishes_with_stop_and_stops_generation(server, model, reference):
    expected = visible(reference[1])
    stop_word = f"w{expected[3]}"
    cut = expected.index(expected[3])  # the first occurrence ends the text
    body = completion_body(model, PROMPTS[1], stop=[stop_word], max_tokens=MAX_TOKENS)
    status, out = http(f"{server.url}/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert words_to_ids(choice["text"]) == expected[:cut]
    assert stop_word not in choice["text"]
    text, finish, _ = stream(f"{server.url}/v1/completions", body)
    assert finish == "stop" and words_to_ids(text) == expected[:cut]
    # vLLM's include_stop_str_in_output: the text ends with the stop string
    kept = http(f"{server.url}/v1/completions", {**body, "include_stop_str_in_output": True})[1]["choices"][0]
    assert kept["finish_reason"] == "stop" and words_to_ids(kept["text"]) == expected[: cut + 1]
    assert wait_until(lambda: metric(server.url, "batchserve_num_requests_running") == 0)


@pytest.mark.parametrize(
    "endpoint, body, param",
    [
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": [5] * 600}, "prompt"),  # longer than the 512-token context
        ("completions", {"prompt": [5] * 500, "max_tokens": 100}, "max_tokens"),  # prompt + max_tokens > context
        ("completions", {"prompt": " ".join(["w9"] * 600)}, "prompt"),  # too long once tokenized
        ("completions", {"prompt": "w5 w6", "max_tokens": 511}, "max_tokens"),
        ("completions", {"prompt": [5, 100000]}, "prompt"),  # outside the vocabulary
        ("chat/completions", {"messages": []}, "messages"),
        ("completions", {"prompt": "w5", "max_tokens": 0}, "max_tokens"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "w5"}], "priority": 3},
            "priority",
        ),  # fcfs server
    ],
)
def test_bad_inputs_get_400_naming_the_field(server, model, endpoint, body, param):
    status, out = http(f"{server.url}/v1/{endpoint}", {"model": str(model), **body})
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_health_models_and_metrics(server, model):
    assert http(f"{server.url}/health")[0] == 200
    status, body = http(f"{server.url}/v1/models")
    assert status == 200 and body["data"][0]["id"] == str(model) and body["data"][0]["max_model_len"] == 512
    assert metric(server.url, "batchserve_kv_cache_total_tokens") == 4096
    assert 0 < metric(server.url, "batchserve_model_weight_bytes") < 50e6  # a tiny model's
