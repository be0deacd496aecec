"""vLLM's `/tokenize` and `/detokenize`: shapes and bad inputs on the fake engine; on a real server with a
tiny model, the ids equal what generation feeds (the `PromptTokenizer`'s, and a completion's
`usage.prompt_tokens`), chat template and tools included."""

from __future__ import annotations

import asyncio
import json

import pytest
from api_fake_engine import FakeEngine
from test_api_app import api


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def post(engine: FakeEngine, path: str, body: object, **kw) -> tuple[int, dict]:
    async def go():
        async with api(engine) as client:
            resp = await client.post(path, json=body, **kw) if "data" not in kw else await client.post(path, **kw)
            return resp.status, await resp.json()

    return run(go())


# ---- on the fake engine


def test_tokenize_a_prompt_shape_and_defaults():
    engine = FakeEngine(max_context=128)
    status, body = post(engine, "/tokenize", {"model": "fake-model", "prompt": "Say hello"})
    assert status == 200, body
    assert body == {"count": 3, "max_model_len": 128, "tokens": [1, 1000, 1001], "token_strs": None}
    ((request, options),) = engine.tokenize_calls
    assert request.prompt == "Say hello" and request.messages is None
    assert options == {
        "add_special_tokens": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "return_token_strs": False,
    }
    status, body = post(
        engine, "/tokenize", {"prompt": "Say hello", "add_special_tokens": False, "return_token_strs": True}
    )
    assert body["tokens"] == [1000, 1001] and body["token_strs"] == ["Say", " hello"]


def test_tokenize_a_chat_passes_the_template_options_and_tools():
    engine = FakeEngine()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    status, body = post(
        engine,
        "/tokenize",
        {
            "messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}],
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": tools,
        },
    )
    assert status == 200, body
    ((request, options),) = engine.tokenize_calls
    assert [m.role for m in request.messages] == ["user", "assistant"] and [t.name for t in request.tools] == ["f"]
    assert request.chat_template_kwargs == {"enable_thinking": False}
    # continue_final_message alone turns the generation prompt off (vLLM's defaults would clash)
    assert options["continue_final_message"] is True and options["add_generation_prompt"] is False
    assert body["tokens"] == [1000, 1001, 1002]  # a chat adds no special tokens beyond its template's


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "prompt"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "y"}]}, "messages[0].role"),
        (
            {
                "messages": [{"role": "user", "content": "y"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            "continue_final_message",
        ),
        ({"messages": [{"role": "user", "content": "y"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ],
)
def test_tokenize_bad_inputs_are_400_naming_the_field(body, param):
    engine = FakeEngine()
    status, answer = post(engine, "/tokenize", body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert engine.tokenize_calls == []


def test_detokenize_and_its_bad_inputs():
    engine = FakeEngine(vocab_size=1000)
    assert post(engine, "/detokenize", {"model": "fake-model", "tokens": [5, 7]}) == (200, {"prompt": "<5><7>"})
    assert post(engine, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
    for tokens in ([-1], [2**31], "12", [1.5]):
        status, answer = post(engine, "/detokenize", {"tokens": tokens})
        assert status == 400 and answer["error"]["param"].startswith("tokens"), (tokens, answer)
    status, answer = post(engine, "/detokenize", {"tokens": [999, 1000]})  # the engine knows the vocabulary
    assert status == 400 and answer["error"]["param"] == "tokens" and "1000" in answer["error"]["message"]
    status, answer = post(engine, "/detokenize", {})
    assert status == 400 and answer["error"]["param"] == "tokens"
    assert engine.detokenize_calls == [[5, 7], [], [999, 1000]]


def test_unknown_model_unhealthy_engine_and_bodies():
    engine = FakeEngine()
    for path, body in [
        ("/tokenize", {"model": "other", "prompt": "x"}),
        ("/detokenize", {"model": "other", "tokens": [1]}),
    ]:
        status, answer = post(engine, path, body)
        assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, answer = post(engine, "/tokenize", None, data=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 400
    status, answer = post(engine, "/tokenize", None, data=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert status == 400
    engine.healthy = False
    status, answer = post(engine, "/tokenize", {"prompt": "x"})
    assert status == 503
    status, answer = post(engine, "/detokenize", {"tokens": [1]})
    assert status == 503


def test_tokenize_applies_the_size_check():
    engine = FakeEngine(max_prompt_chars=10)
    status, answer = post(engine, "/tokenize", {"prompt": "x" * 11})
    assert status == 400 and answer["error"]["param"] == "prompt"
    status, answer = post(engine, "/tokenize", {"messages": [{"role": "user", "content": "x" * 11}]})
    assert status == 400 and answer["error"]["param"] == "messages"


# ---- a real server on a tiny model


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from e2e_server import start_server

    srv = start_server(
        model,
        tmp_path_factory.mktemp("tokenize") / "serve.log",
        "--kv-capacity-tokens",
        "2048",
        "--max-running-requests",
        "4",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prompts(model):
    from batchserve.procs.tokenizer.prompts import PromptTokenizer
    from batchserve.shared.model import ModelSpec

    return PromptTokenizer.of(ModelSpec.resolve(model))


def call(server, path: str, body: dict) -> tuple[int, dict]:
    from e2e_server import http

    return http(f"{server.url}{path}", body)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick brown fox?"}]


def test_tokenize_equals_what_generation_feeds(server, prompts):
    from openai import OpenAI

    from batchserve.shared.messages import ChatMessage, GenerateRequest

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    status, body = call(server, "/tokenize", {"model": name, "prompt": "the lazy dog jumps", "return_token_strs": True})
    assert status == 200, body
    ids, _ = prompts.prompt_ids(GenerateRequest(rid="r", prompt="the lazy dog jumps"))
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 512
    assert body["token_strs"] == prompts.tokenizer.convert_ids_to_tokens(ids)
    usage = client.completions.create(model=name, prompt="the lazy dog jumps", max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]

    status, body = call(server, "/tokenize", {"messages": CHAT})
    assert status == 200, body
    ids, _ = prompts.prompt_ids(GenerateRequest(rid="r", messages=[ChatMessage(**m) for m in CHAT]))
    text = prompts.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == ids == prompts.tokenizer.encode(text, add_special_tokens=False)
    usage = client.chat.completions.create(model=name, messages=CHAT, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]

    status, body = call(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    without = prompts.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert body["tokens"] == prompts.tokenizer.encode(without, add_special_tokens=False)
    assert len(body["tokens"]) < len(ids)


def test_detokenize_round_trip_and_bad_ids_on_a_real_server(server, prompts):
    status, body = call(server, "/tokenize", {"prompt": "the quick brown fox", "add_special_tokens": False})
    assert status == 200, body
    assert call(server, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "the quick brown fox"})
    status, body = call(server, "/detokenize", {"tokens": [1, prompts.vocab_size]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = call(server, "/tokenize", {"prompt": "the quick brown fox " * 500_000})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = call(
        server,
        "/tokenize",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": json.loads('[{"type": "function", "function": {"name": "f"}}]'),
            "chat_template_kwargs": {"tools": []},
        },
    )
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"
