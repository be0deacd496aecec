"""OpenAI/vLLM parity of the api, through the `openai` package against the fake engine: penalties,
logit_bias and min_tokens reaching `GenerateRequest.params.logits`, n choices (fan-out, seeds, prefill once,
usage, aborts), logprobs shapes, echo, and a batch of prompts as lm-evaluation-harness sends them."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine
from test_api_app import _raw_post, sse_events

from batchserve.procs.api.app import create_app
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import LogitsParams

CHAT = [{"role": "user", "content": "hi there"}]
SETTLED_BY_THE_TOKENIZER = {"max_tokens", "min_tokens"}


def run(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


@asynccontextmanager
async def openai_api(engine: FakeEngine, config: ServerConfig | None = None):
    """The app on a free port (handler cancellation on, as `start_api` runs it) and an openai client."""
    async with TestServer(create_app(engine, config or ServerConfig())) as server:
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as client:
            yield client


@asynccontextmanager
async def raw_api(engine: FakeEngine, config: ServerConfig | None = None):
    """For what the openai package hides: [DONE], the order of chunks."""
    async with TestClient(TestServer(create_app(engine, config or ServerConfig()))) as client:
        yield client


def by_choice(tokens_per_choice: dict[str, list[str]]):
    """A FakeEngine `tokens_of`: tokens by the rid's choice suffix ("-0", "-1", ...)."""
    return lambda request: tokens_per_choice[request.rid[request.rid.rindex("-") :]]


def expected_seed(seed: int, j: int) -> int:
    return seed if j == 0 else (seed * 0x9E3779B97F4A7C15 + j) & (2**63 - 1)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "endpoint, fields, param",
    [
        ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"presence_penalty": -2.1}, "presence_penalty"),
        ("completions", {"frequency_penalty": 3}, "frequency_penalty"),
        ("completions", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ("chat", {"extra_body": {"repetition_penalty": -1.0}}, "repetition_penalty"),
        ("completions", {"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ("completions", {"max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens"),
        ("chat", {"max_completion_tokens": 2, "extra_body": {"min_tokens": 3}}, "min_tokens"),
        ("completions", {"logit_bias": {"a": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"+5": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"2147483648": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": -100.5}}, "logit_bias"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"echo": True, "max_tokens": -1}, "max_tokens"),
        ("completions", {"echo": True, "max_tokens": 0, "extra_body": {"min_tokens": 1}}, "min_tokens"),
        ("completions", {"suffix": "!"}, "suffix"),
        ("completions", {"n": 0}, "n"),
        ("chat", {"n": 129}, "n"),
        ("completions", {"n": 3, "best_of": 2}, "best_of"),
        ("completions", {"best_of": 4}, "best_of"),
        ("completions", {"prompt": [[1], "a"]}, "prompt[1]"),
        ("completions", {"prompt": ["a", ""]}, "prompt[1]"),
        ("completions", {"prompt": [[1, 2], [3, -4]]}, "prompt[1][1]"),  # refused while decoding: the element itself
        ("completions", {"prompt": [[1], []]}, "prompt[1]"),
    ],
)
def test_bad_values_of_the_new_fields_are_400_naming_them(endpoint, fields, param):
    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            with pytest.raises(openai.BadRequestError) as info:
                if endpoint == "chat":
                    await client.chat.completions.create(model="fake-model", messages=CHAT, **fields)
                else:
                    await client.completions.create(model="fake-model", **{"prompt": "x", **fields})
        # Refused by the api, but for max_tokens (>= 1) and min_tokens against it: the tokenizer settles
        # them (the fake engine as the tokenizer does), so those requests reach the engine.
        assert engine.requests == [] or param in SETTLED_BY_THE_TOKENIZER, engine.requests
        return info.value

    error = run(go())
    assert error.status_code == 400 and error.param == param, error.body


def test_penalties_logit_bias_and_min_tokens_reach_the_engine():
    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            await client.completions.create(
                model="fake-model",
                prompt="x",
                max_tokens=10,
                presence_penalty=0.5,
                frequency_penalty=-0.5,
                logit_bias={"5": -100, "7": 2.5},
                extra_body={"repetition_penalty": 1.2, "min_tokens": 3},
            )
            await client.chat.completions.create(
                model="fake-model",
                messages=CHAT,
                presence_penalty=-2,
                frequency_penalty=2,
                logit_bias={"0": 100, "2147483647": -100},
                extra_body={"min_tokens": 4},
            )
            await client.completions.create(model="fake-model", prompt="x", extra_body={"min_tokens": 40})
        return engine.requests

    completion, chat, no_max_tokens = run(go())
    assert completion.params.logits == LogitsParams(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_tokens=3,
        logit_bias={5: -100.0, 7: 2.5},
    )
    assert chat.params.logits == LogitsParams(
        presence_penalty=-2.0, frequency_penalty=2.0, min_tokens=4, logit_bias={0: 100.0, 2147483647: -100.0}
    )
    assert no_max_tokens.params.logits.min_tokens == 40  # no max_tokens given: nothing to compare with


def test_logprob_requests_reach_the_engine():
    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            await client.chat.completions.create(model="fake-model", messages=CHAT, logprobs=True, top_logprobs=20)
            await client.chat.completions.create(model="fake-model", messages=CHAT, logprobs=True)
            await client.chat.completions.create(model="fake-model", messages=CHAT, logprobs=False)
            await client.completions.create(model="fake-model", prompt="x", logprobs=5)
            await client.completions.create(model="fake-model", prompt="x", logprobs=0)
            await client.completions.create(model="fake-model", prompt="x", echo=True)
            await client.completions.create(model="fake-model", prompt="x", echo=True, logprobs=3)
        return [(r.params.logits.logprobs, r.params.logits.prompt_logprobs) for r in engine.requests]

    assert run(go()) == [(20, None), (0, None), (None, None), (5, None), (0, None), (None, 0), (3, 3)]


# ------------------------------------------------------------------ n choices


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_whole(endpoint):
    tokens = {"-0": ["a", "b"], "-1": ["c", "d", "e"], "-2": ["f", "g", "h", "i"]}

    async def go():
        engine = FakeEngine(tokens_of=by_choice(tokens), first_delay=0.05)
        async with openai_api(engine) as client:
            if endpoint == "chat":
                out = await client.chat.completions.create(model="fake-model", messages=CHAT, n=3, max_tokens=3, seed=7)
                texts = [c.message.content for c in out.choices]
            else:
                out = await client.completions.create(
                    model="fake-model", prompt="one two", n=3, max_tokens=3, seed=7, best_of=3
                )
                texts = [c.text for c in out.choices]
        return out, texts, engine

    out, texts, engine = run(go())
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert texts == ["ab", "cde", "fgh"]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop", "length"]
    # the prompt counted once, the completions of every choice
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (2, 8, 10)
    assert [r.rid for r in engine.requests] == [f"{out.id}-{j}" for j in range(3)]
    assert [r.params.sampling.seed for r in engine.requests] == [expected_seed(7, j) for j in range(3)]
    # the prompt is prefilled once: choices 1 and 2 go in only after choice 0's first event
    first_event = engine.log.index(f"event {out.id}-0")
    assert engine.log.index(f"submit {out.id}-1") > first_event
    assert engine.log.index(f"submit {out.id}-2") > first_event
    assert engine.aborts == [] and sorted(engine.closed) == sorted(r.rid for r in engine.requests)


def test_choice_seeds_are_distinct_and_n1_is_unchanged():
    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            for seed in (7, 8):
                await client.completions.create(model="fake-model", prompt="x", n=4, seed=seed)
            await client.completions.create(model="fake-model", prompt="x", n=1, seed=7)
            unseeded = await client.completions.create(model="fake-model", prompt="x", n=2)
        return engine.requests, unseeded.id

    requests, unseeded_id = run(go())
    seeds_7 = [r.params.sampling.seed for r in requests[:4]]
    seeds_8 = [r.params.sampling.seed for r in requests[4:8]]
    assert seeds_7[0] == 7 and seeds_8[0] == 8 and not set(seeds_7) & set(seeds_8)
    assert all(0 <= s < 2**63 for s in seeds_7 + seeds_8)
    # n=1: rid and seed as given
    assert requests[8].params.sampling.seed == 7 and "-" not in requests[8].rid[len("cmpl-") :]
    assert [(r.rid, r.params.sampling.seed) for r in requests[9:]] == [
        (f"{unseeded_id}-0", None),
        (f"{unseeded_id}-1", None),
    ]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_streamed(endpoint):
    tokens = {"-0": ["a", "b"], "-1": ["c", "d", "e"], "-2": ["f"]}

    async def go():
        engine = FakeEngine(tokens_of=by_choice(tokens), delay=0.001)
        async with openai_api(engine) as client:
            if endpoint == "chat":
                stream = await client.chat.completions.create(
                    model="fake-model", messages=CHAT, n=3, stream=True, stream_options={"include_usage": True}
                )
            else:
                stream = await client.completions.create(
                    model="fake-model", prompt="one two three", n=3, stream=True, stream_options={"include_usage": True}
                )
            chunks = [chunk async for chunk in stream]
        return chunks, engine

    chunks, engine = run(go())
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens == (2 if endpoint == "chat" else 3)
    assert all(len(c.choices) == 1 and c.usage is None for c in choice_chunks)
    texts, finishes, roles = {0: "", 1: "", 2: ""}, {}, []
    for chunk in choice_chunks:
        (choice,) = chunk.choices
        assert choice.index not in finishes  # nothing after a choice's finish chunk
        if endpoint == "chat":
            if choice.delta.role is not None:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
        else:
            texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert texts == {0: "ab", 1: "cde", 2: "f"} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    if endpoint == "chat":
        assert roles == [0, 1, 2]  # one role chunk per choice, first
    assert engine.aborts == []


def test_n_choices_stream_ends_with_one_usage_chunk_and_one_done():
    async def go():
        engine = FakeEngine(delay=0.001)
        async with raw_api(engine) as client:
            resp = await client.post(
                "/v1/chat/completions",
                json={"messages": CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
            )
            return sse_events(await resp.text())

    events = run(go())
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # the role chunks
    finishes = [e["choices"][0]["index"] for e in events[:-2] if e["choices"][0]["finish_reason"] == "stop"]
    assert sorted(finishes) == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_rejected_choice_0_is_the_answer(stream):
    async def go():
        engine = FakeEngine(reject=(503, "the waiting queue is full", None))
        async with openai_api(engine) as client:
            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(model="fake-model", prompt="x", n=3, stream=stream)
        return info.value, engine

    error, engine = run(go())
    assert error.status_code == 503 and "waiting queue is full" in error.message
    assert len(engine.requests) == 1 and engine.aborts == []  # choices 1 and 2 never went in


def test_a_choice_failing_mid_stream_ends_the_whole_stream():
    async def go():
        engine = FakeEngine(["tok"] * 20, delay=0.01, fail_after=2, fail_suffix="-1")
        async with raw_api(engine) as client:
            resp = await client.post("/v1/completions", json={"prompt": "x", "n": 3, "stream": True, "max_tokens": 20})
            events = sse_events(await resp.text())
        await asyncio.sleep(0.1)
        return events, engine

    events, engine = run(go())
    rid = events[0]["id"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable_error"
    aborts = events[-5:-2]
    assert sorted(e["choices"][0]["index"] for e in aborts) == [0, 1, 2]
    assert all(e["choices"][0]["finish_reason"] == "abort" for e in aborts)
    assert sorted(engine.aborts) == [f"{rid}-0", f"{rid}-2"]  # choice 1 ended itself
    assert sorted(engine.closed) == [f"{rid}-{j}" for j in range(3)]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_every_choice(stream):
    async def go():
        engine = FakeEngine(["tok"] * 100, delay=0.02)
        async with raw_api(engine) as client:
            reader, writer = await _raw_post(
                client.host, client.port, "/v1/chat/completions", {"messages": CHAT, "n": 3, "stream": stream}
            )
            if stream:
                await reader.readuntil(b"data: ")
            else:
                while len(engine.requests) < 3:
                    await asyncio.sleep(0.01)
            writer.close()
            await writer.wait_closed()
            await asyncio.wait_for(engine.aborted.wait(), 5)
            await asyncio.sleep(0.2)  # any extra (wrong) abort would land meanwhile
        return engine

    engine = run(go())
    rids = sorted(r.rid for r in engine.requests)
    assert len(rids) == 3 and sorted(engine.aborts) == rids and sorted(engine.closed) == rids


def test_disconnect_through_the_openai_client_aborts_every_choice():
    async def go():
        engine = FakeEngine(["tok"] * 100, delay=0.02)
        async with openai_api(engine) as client:
            stream = await client.completions.create(model="fake-model", prompt="x", n=2, stream=True, max_tokens=100)
            async for _ in stream:
                break
            await stream.close()
            await asyncio.wait_for(engine.aborted.wait(), 5)
            await asyncio.sleep(0.2)
        return engine

    engine = run(go())
    rids = sorted(r.rid for r in engine.requests)
    assert len(rids) == 2 and sorted(engine.aborts) == rids


def test_n_counts_toward_the_in_flight_cap():
    async def go():
        engine = FakeEngine(first_delay=0.3)
        async with openai_api(engine, ServerConfig(max_running_requests=1, max_waiting=1)) as client:
            with pytest.raises(openai.BadRequestError) as too_many:  # could never fit
                await client.completions.create(model="fake-model", prompt="x", n=3)
            with pytest.raises(openai.BadRequestError) as too_many_prompts:
                await client.completions.create(model="fake-model", prompt=["a", "b", "c"])
            held = asyncio.create_task(client.completions.create(model="fake-model", prompt="x", n=2))
            while not engine.requests:
                await asyncio.sleep(0.01)
            with pytest.raises(openai.APIStatusError) as full:
                await client.completions.create(model="fake-model", prompt="x")
            assert len((await held).choices) == 2
            assert len((await client.completions.create(model="fake-model", prompt="x", n=2)).choices) == 2
        return too_many.value, too_many_prompts.value, full.value

    too_many, too_many_prompts, full = run(go())
    assert too_many.param == "n" and "at most 2" in too_many.message
    assert too_many_prompts.param == "prompt"
    assert full.status_code == 503 and "capacity" in full.message


# ------------------------------------------------------------------ logprobs shapes


def chat_entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
    }


CHAT_LOGPROBS = [
    chat_entry("Hello", -0.25, [("Hello", -0.25), ("alt1", -1.25)]),
    chat_entry(",", -0.5, [(",", -0.5), ("alt1", -1.5)]),
    chat_entry(" world", -0.75, [(" world", -0.75), ("alt1", -1.75)]),
    chat_entry("!", -1.0, [("!", -1.0), ("alt1", -2.0)]),
]


def test_chat_logprobs_whole_and_streamed():
    async def go():
        engine = FakeEngine(["Hello", ",", " world", "!", "é"], delay=0.001)
        async with openai_api(engine) as client:
            whole = await client.chat.completions.create(
                model="fake-model", messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2
            )
            plain = await client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=4)
            zero = await client.chat.completions.create(model="fake-model", messages=CHAT, logprobs=True)
            stream = await client.chat.completions.create(
                model="fake-model", messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2, stream=True
            )
            chunks = [c async for c in stream]
        return whole, plain, zero, chunks

    whole, plain, zero, chunks = run(go())
    assert whole.choices[0].logprobs.model_dump() == {"content": CHAT_LOGPROBS, "refusal": None}
    assert plain.choices[0].logprobs is None
    assert zero.choices[0].logprobs.content[4].model_dump() == {
        "token": "é",
        "logprob": -1.25,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [],
    }
    content_chunks = [c.choices[0] for c in chunks if c.choices[0].delta.content]
    assert [c.logprobs.model_dump() for c in content_chunks] == [
        {"content": [e], "refusal": None} for e in CHAT_LOGPROBS
    ]
    assert chunks[0].choices[0].logprobs is None and chunks[-1].choices[0].logprobs is None  # role, finish


COMPLETION_LOGPROBS = {
    "tokens": ["Hello", ",", " world", "!"],
    "token_logprobs": [-0.25, -0.5, -0.75, -1.0],
    # as vLLM's: the top alternatives and the token itself
    "top_logprobs": [
        {"Hello": -0.25, "alt1": -1.25},
        {",": -0.5, "alt1": -1.5},
        {" world": -0.75, "alt1": -1.75},
        {"!": -1.0, "alt1": -2.0},
    ],
    "text_offset": [0, 5, 6, 12],
}


def test_completion_logprobs_whole_and_streamed():
    async def go():
        engine = FakeEngine(delay=0.001)
        async with openai_api(engine) as client:
            whole = await client.completions.create(model="fake-model", prompt="x", logprobs=2)
            zero = await client.completions.create(model="fake-model", prompt="x", logprobs=0)
            plain = await client.completions.create(model="fake-model", prompt="x")
            stream = await client.completions.create(model="fake-model", prompt="x", logprobs=2, stream=True)
            chunks = [c.choices[0] async for c in stream]
        return whole, zero, plain, chunks

    whole, zero, plain, chunks = run(go())
    assert whole.choices[0].logprobs.model_dump() == COMPLETION_LOGPROBS
    assert zero.choices[0].logprobs.top_logprobs == [{"Hello": -0.25}, {",": -0.5}, {" world": -0.75}, {"!": -1.0}]
    assert plain.choices[0].logprobs is None
    *text_chunks, finish = chunks
    assert finish.finish_reason == "stop" and finish.logprobs is None
    for i, chunk in enumerate(text_chunks):  # each chunk: its own token, at its offset in the whole text
        assert chunk.logprobs.model_dump() == {key: [value[i]] for key, value in COMPLETION_LOGPROBS.items()}


def test_n_choices_each_have_their_logprobs():
    async def go():
        engine = FakeEngine(tokens_of=by_choice({"-0": ["a", "b"], "-1": ["cc", "d"]}))
        async with openai_api(engine) as client:
            return await client.completions.create(model="fake-model", prompt="x", n=2, logprobs=1)

    out = run(go())
    assert [c.logprobs.tokens for c in out.choices] == [["a", "b"], ["cc", "d"]]
    assert [c.logprobs.text_offset for c in out.choices] == [[0, 1], [0, 2]]


# ------------------------------------------------------------------ echo


def test_echo_without_logprobs():
    async def go():
        engine = FakeEngine(delay=0.001)
        async with openai_api(engine) as client:
            whole = await client.completions.create(model="fake-model", prompt="Say hello", echo=True)
            stream = await client.completions.create(model="fake-model", prompt="Say hello", echo=True, stream=True)
            chunks = [c.choices[0] async for c in stream]
        return whole, chunks

    whole, chunks = run(go())
    assert whole.choices[0].text == "Say helloHello, world!" and whole.choices[0].logprobs is None
    assert whole.usage.prompt_tokens == 2 and whole.usage.completion_tokens == 4
    assert chunks[0].text == "Say helloHello"  # the first chunk starts with the prompt
    assert "".join(c.text for c in chunks) == "Say helloHello, world!"
    assert all(c.logprobs is None for c in chunks)


ECHO_LOGPROBS = {
    "tokens": ["Say", " hello", "Hello", ",", " world", "!"],
    "token_logprobs": [None, -1.0, -0.25, -0.5, -0.75, -1.0],
    "top_logprobs": [
        None,
        {" p1": -0.5, " hello": -1.0},
        {"Hello": -0.25},
        {",": -0.5},
        {" world": -0.75},
        {"!": -1.0},
    ],
    "text_offset": [0, 3, 9, 14, 15, 21],
}


def test_echo_with_logprobs_whole_and_streamed():
    async def go():
        engine = FakeEngine(delay=0.001)
        async with openai_api(engine) as client:
            whole = await client.completions.create(model="fake-model", prompt="Say hello", echo=True, logprobs=1)
            stream = await client.completions.create(
                model="fake-model", prompt="Say hello", echo=True, logprobs=1, stream=True
            )
            chunks = [c.choices[0] async for c in stream]
        return whole, chunks

    whole, chunks = run(go())
    assert whole.choices[0].text == "Say helloHello, world!"
    assert whole.choices[0].logprobs.model_dump() == ECHO_LOGPROBS
    first = chunks[0]
    assert first.text == "Say helloHello"
    assert first.logprobs.model_dump() == {key: value[:3] for key, value in ECHO_LOGPROBS.items()}
    merged = {key: [v for c in chunks[:-1] for v in getattr(c.logprobs, key)] for key in ECHO_LOGPROBS}
    assert merged == ECHO_LOGPROBS


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_answers_the_prompt_alone(stream):
    async def go():
        engine = FakeEngine(delay=0.001)
        async with raw_api(engine) as client:
            resp = await client.post(
                "/v1/completions",
                json={
                    "prompt": "Say hello",
                    "echo": True,
                    "max_tokens": 0,
                    "logprobs": 1,
                    "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {}),
                },
            )
            assert resp.status == 200
            body = sse_events(await resp.text()) if stream else await resp.json()
        return body, engine

    body, engine = run(go())
    (request,) = engine.requests
    assert request.params.stop.max_tokens == 1 and request.params.logits.prompt_logprobs == 1
    prompt_only = {key: value[:2] for key, value in ECHO_LOGPROBS.items()}
    if stream:
        *chunks, usage_chunk, done = body
        assert [c["choices"][0]["text"] for c in chunks] == ["Say hello", ""]
        assert chunks[0]["choices"][0]["logprobs"] == prompt_only
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        usage = usage_chunk["usage"]
    else:
        (choice,) = body["choices"]
        assert choice["text"] == "Say hello" and choice["finish_reason"] == "length"
        assert choice["logprobs"] == prompt_only
        usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (2, 0, 2)


def test_echo_with_n_choices_asks_the_prompt_logprobs_once():
    async def go():
        engine = FakeEngine(tokens_of=by_choice({"-0": ["a"], "-1": ["b"]}))
        async with openai_api(engine) as client:
            out = await client.completions.create(model="fake-model", prompt="Say hello", echo=True, logprobs=1, n=2)
        return out, engine

    out, engine = run(go())
    assert [r.params.logits.prompt_logprobs for r in engine.requests] == [1, None]  # choice 1 repeats choice 0's
    assert [c.text for c in out.choices] == ["Say helloa", "Say hellob"]
    assert out.choices[1].logprobs.tokens == ["Say", " hello", "b"]
    assert out.choices[1].logprobs.token_logprobs == [None, -1.0, -0.25]


# ------------------------------------------------------------------ a batch of prompts (lm-evaluation-harness)


def test_lm_eval_loglikelihood_request_and_parsing():
    """lm-evaluation-harness's `local-completions` loglikelihood path: a batch of token-id prompts, echo,
    max_tokens 1, logprobs 1; it reads `token_logprobs[ctxlen:-1]` and `top_logprobs[ctxlen:-1]` of the
    choices sorted by index (one per prompt)."""

    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            out = await client.completions.create(
                model="fake-model",
                prompt=[[1, 2, 3], [4, 5]],
                temperature=0,
                max_tokens=1,
                logprobs=1,
                echo=True,
                seed=1234,
            )
        return out.model_dump(), engine

    out, engine = run(go())
    assert [r.rid for r in engine.requests] == [f"{out['id']}-0", f"{out['id']}-1"]
    assert [r.prompt_token_ids for r in engine.requests] == [[1, 2, 3], [4, 5]]
    assert all(r.params.sampling.seed == 1234 and r.params.logits.prompt_logprobs == 1 for r in engine.requests)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == ["<1><2><3>Hello", "<4><5>Hello"]
    results = []
    for choice, ctxlen in zip(choices, [1, 1]):  # as lm_eval.models.openai_completions.parse_logprobs
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(
            tok == max(top.values()) for tok, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1], tops)
        )
        results.append((logprobs, greedy))
    assert results == [(-3.0, False), (-1.0, False)]
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 2


def test_a_batch_of_text_prompts_with_n_choices():
    async def go():
        engine = FakeEngine(tokens_of=lambda r: [r.prompt.upper()], first_delay=0.05)
        async with openai_api(engine) as client:
            out = await client.completions.create(model="fake-model", prompt=["ab", "cd ef"], n=2, seed=3)
        return out, engine

    out, engine = run(go())
    assert [(c.index, c.text) for c in out.choices] == [(0, "AB"), (1, "AB"), (2, "CD EF"), (3, "CD EF")]
    assert [r.rid for r in engine.requests][:1] == [f"{out.id}-0"]
    by_rid = {r.rid: r for r in engine.requests}
    assert [by_rid[f"{out.id}-{i}"].params.sampling.seed for i in range(4)] == [
        3,
        expected_seed(3, 1),
        3,
        expected_seed(3, 1),
    ]
    for leader, follower in ((0, 1), (2, 3)):  # each prompt prefilled once
        assert engine.log.index(f"submit {out.id}-{follower}") > engine.log.index(f"event {out.id}-{leader}")
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4


def test_an_engine_rejection_of_one_prompt_of_a_batch_names_it():
    async def go():
        engine = FakeEngine(reject=(400, "the prompt is too long", "prompt"))
        async with openai_api(engine) as client:
            with pytest.raises(openai.BadRequestError) as batch:
                await client.completions.create(model="fake-model", prompt=["a", "b"], n=2)
            with pytest.raises(openai.BadRequestError) as single:
                await client.completions.create(model="fake-model", prompt="a", n=2)
        return batch.value, single.value

    batch, single = run(go())
    assert batch.param == "prompt[0]" and single.param == "prompt"
