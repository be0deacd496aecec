"""The api's HTTP app against an in-process fake engine: shapes, streaming, errors, admission, aborts."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import PLAIN_LOGITS, SamplingParams, StopParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


@asynccontextmanager
async def api(engine: FakeEngine, config: ServerConfig | None = None):
    """A real HTTP server on a free port (handler cancellation on, as `start_api` runs it) and a client."""
    async with TestClient(TestServer(create_app(engine, config or ServerConfig()))) as client:
        yield client


def sse_events(text: str) -> list:
    """`data: ...` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- non-streaming shapes


def test_completion_whole_answer_shape_and_defaults():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            resp = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "Say hello to me"})
            assert resp.status == 200
            body = await resp.json()
        assert body["id"].startswith("cmpl-") and resp.headers["X-Request-Id"] == body["id"]
        assert body["object"] == "text_completion" and body["model"] == "fake-model"
        assert isinstance(body["created"], int)
        assert body["choices"] == [{"index": 0, "text": "Hello, world!", "logprobs": None, "finish_reason": "stop"}]
        assert body["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 4,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        (req,) = engine.requests
        assert req.rid == body["id"] and req.prompt == "Say hello to me" and req.prompt_token_ids is None
        assert req.params.sampling == SamplingParams()  # temperature 1, top_p 1, top_k -1, min_p 0, no seed
        assert req.params.stop == StopParams() and req.params.stop.max_tokens is None  # the tokenizer's default
        assert req.arrival_time > 0
        assert engine.aborts == []  # a normal finish never aborts

    run(go())


def test_completion_token_id_prompt_and_all_parameters():
    async def go():
        engine = FakeEngine(max_context=20)
        async with api(engine) as client:
            resp = await client.post(
                "/v1/completions",
                json={
                    "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
                    "temperature": 0.5,
                    "top_p": 0.9,
                    "top_k": 40,
                    "min_p": 0.05,
                    "seed": 7,
                    "stop": "\n",
                    "stop_token_ids": [2, 3],
                    "ignore_eos": True,
                    "n": 1,
                    "user": "ignored-unknown-field",
                },
            )
            assert resp.status == 200, await resp.text()
            resp2 = await client.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": 2, "stop": ["a", "b"]})
            body2 = await resp2.json()
        first, second = engine.requests
        assert first.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and first.prompt is None
        assert first.params.sampling == SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7)
        # default max_tokens: left to the tokenizer
        assert first.params.stop == StopParams(ignore_eos=True, stop_token_ids=(2, 3), stop=("\n",))
        assert first.params.stop.max_tokens is None
        assert second.params.stop.max_tokens == 2 and second.params.stop.stop == ("a", "b")
        assert body2["choices"][0]["text"] == "Hello," and body2["choices"][0]["finish_reason"] == "length"
        assert body2["usage"]["completion_tokens"] == 2

    run(go())


def test_chat_whole_answer_shape_and_defaults():
    async def go():
        engine = FakeEngine(max_context=64)
        async with api(engine) as client:
            resp = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "fake-model",
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
                        },
                    ],
                },
            )
            assert resp.status == 200
            body = await resp.json()
            await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 3},
            )
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert body["choices"] == [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello, world!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ]
        assert body["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 4,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        first, second = engine.requests
        assert [(m.role, m.content) for m in first.messages] == [("system", "Be brief."), ("user", "hi\nthere")]
        assert first.prompt is None and first.prompt_token_ids is None
        # chat default: left to the tokenizer (the context the prompt leaves)
        assert first.params.stop.max_tokens is None
        assert (second.params.stop.max_tokens, second.max_tokens_param) == (3, "max_completion_tokens")  # it wins

    run(go())


def test_explicit_nulls_mean_defaults():
    async def go():
        engine = FakeEngine()
        nulls = {
            k: None
            for k in (
                "model",
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "n",
                "stream",
                "stream_options",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "min_tokens",
                "logit_bias",
                "best_of",
                "logprobs",
                "priority",
            )
        }
        async with api(engine) as client:
            assert (await client.post("/v1/completions", json={"prompt": "x", "echo": None, **nulls})).status == 200
            assert (
                await client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "x"}],
                        "max_completion_tokens": None,
                        "top_logprobs": None,
                        **nulls,
                    },
                )
            ).status == 200
        for req in engine.requests:
            params = req.params
            assert params.sampling == SamplingParams() and params.stop == StopParams(max_tokens=params.stop.max_tokens)
            assert req.params.logits == PLAIN_LOGITS and req.params.priority == 0

    run(go())


def test_priority_reaches_the_engine_for_every_choice():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            assert (await client.post("/v1/completions", json={"prompt": "x", "priority": -5, "n": 2})).status == 200
            assert (
                await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "priority": 7}
                )
            ).status == 200
        assert [req.params.priority for req in engine.requests] == [-5, -5, 7]

    run(go())


def test_a_request_opts_out_of_speculative_decoding():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            assert (await client.post("/v1/completions", json={"prompt": "x", "speculative": False})).status == 200
            assert (
                await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "speculative": False}
                )
            ).status == 200
            assert (await client.post("/v1/responses", json={"input": "x", "speculative": False})).status == 200
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
            resp = await client.post("/v1/completions", json={"prompt": "x", "speculative": "no"})
            assert resp.status == 400 and "speculative" in (await resp.json())["error"]["message"]
        assert [req.params.speculative for req in engine.requests] == [False, False, False, True]

    run(go())


def test_priority_outside_32_bits_is_a_400_naming_it():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            for priority in (2**31, -(2**31) - 1, 2**70):
                resp = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "priority": priority}
                )
                assert resp.status == 400, priority
                assert (await resp.json())["error"]["param"] == "priority"
            assert (await client.post("/v1/responses", json={"input": "x", "priority": 2**70})).status == 400
        assert engine.requests == []

    run(go())


# ---- streaming shapes


def test_completion_stream_chunks():
    async def go():
        engine = FakeEngine(delay=0.001)
        async with api(engine) as client:
            resp = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
        assert all("usage" not in c for c in chunks)
        assert [c["choices"][0]["text"] for c in chunks] == ["Hello", ",", " world", "!", ""]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "stop"]
        assert engine.aborts == []

    run(go())


def test_a_token_without_text_of_its_own_still_gets_its_chunk_and_the_bench_counts_it():
    """As vLLM streams: a chunk per delta that made tokens, with empty text where they have none yet (the
    first two bytes of a three-byte character), so a client sees every step and can count tokens by chunks."""
    from batchserve.loadtests.sse import StreamReader, carries_token

    async def go():
        engine = FakeEngine(["a", "", "", "中"])
        async with api(engine) as client:
            completion = await (await client.post("/v1/completions", json={"prompt": "hi", "stream": True})).text()
            chat = await (
                await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
                )
            ).text()
        return completion, chat

    completion, chat = run(go())
    chunks = sse_events(completion)[:-1]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "", "", "中", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["stop"]
    deltas = [c["choices"][0]["delta"] for c in sse_events(chat)[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "a"},
        {"content": ""},
        {"content": ""},
        {"content": "中"},
        {},
    ]
    for body in (completion, chat):  # the role chunk and the finish chunk carry no token
        reader = StreamReader()
        for line in body.splitlines():
            reader.feed(line)
        assert reader.text == "a中" and len(reader.chunk_times) == 4
    first_with_role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None}]}
    assert carries_token(first_with_role)  # a server that sends the first token with the role


def test_completion_stream_include_usage():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            resp = await client.post(
                "/v1/completions",
                json={"prompt": "one two three", "stream": True, "stream_options": {"include_usage": True}},
            )
            events = sse_events(await resp.text())
        *chunks, usage_chunk, done = events
        assert done == "[DONE]"
        assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
        assert usage_chunk["choices"] == [] and usage_chunk["object"] == "text_completion"
        assert usage_chunk["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    run(go())


def test_chat_stream_chunks_and_usage():
    async def go():
        engine = FakeEngine(delay=0.001)
        async with api(engine) as client:
            plain = sse_events(
                await (
                    await client.post(
                        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
                    )
                ).text()
            )
            with_usage = sse_events(
                await (
                    await client.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": "hi"}],
                            "stream": True,
                            "stream_options": {"include_usage": True},
                        },
                    )
                ).text()
            )
        assert plain[-1] == "[DONE]"
        chunks = plain[:-1]
        assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[1:-1] == [{"content": t} for t in ["Hello", ",", " world", "!"]]
        assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        *chunks_u, usage_chunk, done = with_usage
        assert done == "[DONE]" and usage_chunk["choices"] == []
        assert usage_chunk["object"] == "chat.completion.chunk"
        assert usage_chunk["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": 4,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert all(c["usage"] is None for c in chunks_u)
        assert engine.aborts == []

    run(go())


# ---- 400s: every bad input names its field and never reaches the engine

BAD_COMPLETIONS = [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),  # below the field's range: refused while decoding
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop[0]"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "min_p": 1.01}, "min_p"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ({"prompt": [2**31]}, "prompt[0]"),
    ({"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids[0]"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
]

BAD_CHATS = [
    ({"model": "fake-model"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": -1}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
]


def _check_bad(path: str, cases):
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            for body, param in cases:
                kwargs = (
                    {"data": body, "headers": {"Content-Type": "application/json"}}
                    if isinstance(body, bytes)
                    else {"json": body}
                )
                # (the stream_options case is valid once stream is on)
                for stream in (False, True) if param != "stream_options" else (False,):
                    if stream and isinstance(body, dict):
                        kwargs = {"json": {**body, "stream": True}}
                    resp = await client.post(path, **kwargs)
                    assert resp.status == 400, (body, await resp.text())
                    err = (await resp.json())["error"]
                    assert err["type"] == "invalid_request_error" and err["code"] is None, err
                    assert err["param"] == param, (body, err)
                    assert err["message"]
        assert engine.requests == []  # nothing invalid reached the engine

    run(go())


# max_tokens against the context is settled by the tokenizer (the fake engine does it as the tokenizer
# does): its refusal still reaches the client as a 400 naming the field, streamed or not.
REFUSED_BY_THE_TOKENIZER = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 128}, "max_tokens", "you requested 129 tokens"),
    ("/v1/completions", {"prompt": [1] * 100, "max_tokens": 29}, "max_tokens", "(100 in the prompt, 29 in"),
    ("/v1/completions", {"prompt": [1] * 128}, "prompt", "the prompt has 128 tokens"),
    ("/v1/completions", {"prompt": [[1], [1] * 128]}, "prompt[1]", "the prompt has 128 tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        "max_completion_tokens",
        "max_completion_tokens must be at least 1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000},
        "max_tokens",
        "Please reduce the prompt or max_tokens",
    ),
]


def test_max_tokens_refused_by_the_tokenizer_is_a_400_naming_the_field():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            for path, body, param, message in REFUSED_BY_THE_TOKENIZER:
                for stream in (False, True):
                    resp = await client.post(path, json={**body, "stream": stream})
                    assert resp.status == 400 and resp.content_type == "application/json", (body, await resp.text())
                    err = (await resp.json())["error"]
                    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, None), err
                    assert message in err["message"], err
        assert engine.requests  # the engine (its tokenizer) answered

    run(go())


def test_bad_completion_requests_are_400_naming_the_field():
    _check_bad("/v1/completions", BAD_COMPLETIONS)


def test_bad_chat_requests_are_400_naming_the_field():
    _check_bad("/v1/chat/completions", BAD_CHATS)


def test_an_unknown_model_is_404_model_not_found():
    # As OpenAI and vLLM answer: clients catch `openai.NotFoundError`.
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            for path, body in (
                ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "model": "nope", "stream": True},
                ),
            ):
                resp = await client.post(path, json=body)
                assert resp.status == 404, await resp.text()
                err = (await resp.json())["error"]
                assert err["code"] == "model_not_found" and err["param"] == "model", err
                assert body["model"] in err["message"]
        assert engine.requests == []

    run(go())


# ---- rejections, admission, health


@pytest.mark.parametrize("stream", [False, True])
def test_engine_rejection_becomes_its_status(stream):
    async def go():
        too_long = FakeEngine(reject=(400, "prompt is 300 tokens, the context is 128", "prompt"))
        async with api(too_long) as client:
            resp = await client.post("/v1/completions", json={"prompt": "long", "stream": stream})
            assert resp.status == 400 and resp.headers["Content-Type"].startswith("application/json")
            assert (await resp.json())["error"] == {
                "message": "prompt is 300 tokens, the context is 128",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": None,
            }
        full = FakeEngine(reject=(503, "waiting queue is full", None))
        async with api(full) as client:
            resp = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            )
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["message"] == "waiting queue is full"
        assert too_long.aborts == [] and full.aborts == []  # a rejected request is already gone

    run(go())


def test_api_caps_requests_in_flight_with_503_and_retry_after():
    async def go():
        engine = FakeEngine(first_delay=0.3)
        config = ServerConfig(max_running_requests=1, max_waiting=1)
        async with api(engine, config) as client:
            slow = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"})) for _ in range(2)]
            while len(engine.requests) < 2:
                await asyncio.sleep(0.01)
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert "capacity" in (await resp.json())["error"]["message"]
            assert [r.status for r in await asyncio.gather(*slow)] == [200, 200]
            engine.first_delay = 0
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
        assert len(engine.requests) == 3

    run(go())


def test_health_and_unhealthy_engine():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            assert (await client.get("/health")).status == 200
            engine.healthy = False
            assert (await client.get("/health")).status == 503
            resp = await client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            engine.healthy = True
            assert (await client.get("/health")).status == 200
        assert engine.requests == []

    run(go())


def test_models_and_unknown_routes():
    async def go():
        async with api(FakeEngine(max_context=256)) as client:
            body = await (await client.get("/v1/models")).json()
            assert body["object"] == "list"
            assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("fake-model", "model", 256)]
            resp = await client.get("/v1/nothing")
            assert resp.status == 404 and "error" in await resp.json()
            resp = await client.get("/v1/completions")
            assert resp.status == 405 and (await resp.json())["error"]["type"] == "invalid_request_error"

    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_is_a_500_error_body(stream):
    async def go():
        engine = FakeEngine(fail_with=RuntimeError("tokenizer socket closed"))
        async with api(engine) as client:
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert resp.status == 500
            err = (await resp.json())["error"]
            assert "tokenizer socket closed" in err["message"] and err["type"] == "server_error"
        assert engine.aborts == [engine.requests[0].rid]  # best effort: free whatever the engine holds

    run(go())


# ---- disconnects: abort exactly once


async def _raw_post(host: str, port: int, path: str, payload: dict):
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(payload).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


async def _disconnect_and_check_abort(
    engine: FakeEngine, host: str, port: int, path: str, payload: dict, after_first_token: bool
) -> None:
    reader, writer = await _raw_post(host, port, path, payload)
    if after_first_token:
        await reader.readuntil(b"data: ")
    else:
        await engine.received.wait()
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(engine.aborted.wait(), 5)
    await asyncio.sleep(0.2)  # an extra (wrong) abort would land meanwhile
    (req,) = engine.requests
    assert engine.aborts == [req.rid]
    assert engine.closed == [req.rid]  # the app closed the engine's stream too


@pytest.mark.parametrize(
    "path,payload",
    [
        ("/v1/completions", {"prompt": "x", "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
    ],
)
def test_disconnect_mid_stream_aborts_once(path, payload):
    async def go():
        engine = FakeEngine(["tok"] * 100, delay=0.02)
        async with api(engine) as client:
            await _disconnect_and_check_abort(engine, client.host, client.port, path, payload, after_first_token=True)

    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token_aborts_once(stream):
    async def go():
        engine = FakeEngine(first_delay=30)
        async with api(engine) as client:
            await _disconnect_and_check_abort(
                engine,
                client.host,
                client.port,
                "/v1/completions",
                {"prompt": "x", "stream": stream},
                after_first_token=False,
            )

    run(go())


def test_disconnect_mid_stream_without_handler_cancellation_aborts_on_write_error():
    """The other path: the handler is not cancelled, its next write fails (ConnectionResetError)."""

    async def go():
        engine = FakeEngine(["tok"] * 200, delay=0.02)
        runner = web.AppRunner(create_app(engine, ServerConfig()), handler_cancellation=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            await _disconnect_and_check_abort(
                engine, "127.0.0.1", port, "/v1/completions", {"prompt": "x", "stream": True}, after_first_token=True
            )
        finally:
            await runner.cleanup()

    run(go())


def test_client_session_reads_full_stream_without_abort():
    async def go():
        engine = FakeEngine(["a"] * 50)
        async with api(engine) as client:
            async with ClientSession() as session:
                url = f"http://{client.host}:{client.port}/v1/completions"
                async with session.post(url, json={"prompt": "x", "stream": True, "max_tokens": 50}) as resp:
                    events = sse_events(await resp.text())
        assert len(events) == 52 and events[-1] == "[DONE]"
        assert engine.aborts == [] and len(engine.closed) == 1

    run(go())
