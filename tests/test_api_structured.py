"""Structured output, tool calls and reasoning at the api (issue 17), against the fake engine and
through the real `openai` package: what each request field becomes in `GenerateRequest`, the 400s
that name the field, and the parsing of tool calls and `<think>` reasoning out of the engine's text,
whole and streamed."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager

import openai
import pydantic
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine
from test_api_app import sse_events

from batchserve.procs.api.app import create_app
from batchserve.procs.api.chat_output import ChatOutputStream, parse_whole
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import ChatMessage, OutputConstraint, ToolCall, ToolFunction

CHAT = [{"role": "user", "content": "hi there"}]
CALL_ID_RE = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def run(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


@asynccontextmanager
async def openai_api(engine: FakeEngine, *, reasoning: ReasoningFormat = "", sent: list | None = None):
    """The app and an openai client; `sent` collects the JSON bodies the client posts."""

    @web.middleware
    async def record(request: web.Request, handler):
        if sent is not None and request.method == "POST":
            sent.append(json.loads(await request.read()))  # read() keeps the body for the handler
        return await handler(request)

    app = create_app(engine, ServerConfig(), reasoning=reasoning)
    app.middlewares.append(record)
    async with TestServer(app) as server:
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as client:
            yield client


@asynccontextmanager
async def raw_api(engine: FakeEngine, *, reasoning: ReasoningFormat = ""):
    async with TestClient(TestServer(create_app(engine, ServerConfig(), reasoning=reasoning))) as client:
        yield client


def pieces(text: str, size: int = 3) -> list[str]:
    """`text` as engine deltas of `size` characters: markup arrives split across deltas."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def hermes(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ------------------------------------------------------------------ structured output -> OutputConstraint


def test_response_format_and_guided_fields_reach_the_engine():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            chat = client.chat.completions.create
            await chat(model="fake-model", messages=CHAT, response_format={"type": "json_object"})
            await chat(model="fake-model", messages=CHAT, response_format={"type": "text"})
            await chat(
                model="fake-model",
                messages=CHAT,
                response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}},
            )
            await chat(model="fake-model", messages=CHAT, extra_body={"guided_json": schema})
            await chat(model="fake-model", messages=CHAT, extra_body={"guided_json": json.dumps(schema)})
            await chat(model="fake-model", messages=CHAT, extra_body={"guided_regex": r"\d+"})
            await chat(model="fake-model", messages=CHAT, extra_body={"guided_choice": ["yes", "no"]})
            await chat(model="fake-model", messages=CHAT, extra_body={"guided_grammar": 'start: "a"+'})
            await client.completions.create(
                model="fake-model", prompt="x", extra_body={"response_format": {"type": "json_object"}}
            )
            await client.completions.create(model="fake-model", prompt="x", extra_body={"guided_choice": ["a"]})
            await client.completions.create(model="fake-model", prompt=["x", "y"], extra_body={"guided_regex": "b"})
            await chat(model="fake-model", messages=CHAT)
        return [r.params.constraint for r in engine.requests]

    schema_text = json.dumps(schema)
    assert run(go()) == [
        OutputConstraint(kind="json_object", param="response_format"),
        None,
        OutputConstraint(kind="json_schema", spec=schema_text, param="response_format"),
        OutputConstraint(kind="json_schema", spec=schema_text, param="guided_json"),
        OutputConstraint(kind="json_schema", spec=schema_text, param="guided_json"),
        OutputConstraint(kind="regex", spec=r"\d+", param="guided_regex"),
        OutputConstraint(kind="choice", spec='["yes", "no"]', param="guided_choice"),
        OutputConstraint(kind="lark", spec='start: "a"+', param="guided_grammar"),
        OutputConstraint(kind="json_object", param="response_format"),
        OutputConstraint(kind="choice", spec='["a"]', param="guided_choice"),
        OutputConstraint(kind="regex", spec="b", param="guided_regex"),  # each prompt of the batch
        OutputConstraint(kind="regex", spec="b", param="guided_regex"),
        None,
    ]


class City(pydantic.BaseModel):
    name: str
    population: int


def test_parse_with_a_pydantic_model_sends_its_schema_as_the_constraint():
    answer = '{"name": "Paris", "population": 2102650}'

    async def go():
        engine = FakeEngine(pieces(answer))
        sent: list = []
        async with openai_api(engine, sent=sent) as client:
            out = await client.chat.completions.parse(model="fake-model", messages=CHAT, response_format=City)
        return out, sent, engine

    out, (body,), engine = run(go())
    (request,) = engine.requests
    assert body["response_format"]["type"] == "json_schema"
    assert request.params.constraint.kind == "json_schema" and request.params.constraint.param == "response_format"
    assert json.loads(request.params.constraint.spec) == body["response_format"]["json_schema"]["schema"]
    assert out.choices[0].message.parsed == City(name="Paris", population=2102650)


# ------------------------------------------------------------------ 400s naming the field

BAD = [
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {}}, "response_format"),
    ("chat", {"response_format": "json"}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}}, "response_format"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": [1]}}},
        "response_format",
    ),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": []}}, "response_format"),
    ("chat", {"guided_json": "{not json"}, "guided_json"),
    ("chat", {"guided_json": [1, 2]}, "guided_json"),
    ("completions", {"guided_json": "[1]"}, "guided_json"),
    ("chat", {"guided_regex": ""}, "guided_regex"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_choice": [1]}, "guided_choice[0]"),
    ("chat", {"guided_grammar": " "}, "guided_grammar"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("completions", {"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
    ("chat", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ("chat", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ("chat", {"tools": TOOLS + [{"type": "function", "function": {"name": "get_time"}}]}, "tools[2].function.name"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        "tools[0].function.parameters",
    ),
    ("chat", {"tools": "all"}, "tools"),
    ("chat", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": "auto", "tools": []}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "custom", "function": {"name": "get_time"}}}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (
        "chat",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "guided_regex": "a"},
        "tool_choice",
    ),
    ("chat", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("chat", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": "a",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages[0].tool_calls",
    ),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].id",
    ),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "web", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].type",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "sunny"}]},
        "messages[1].tool_call_id",
    ),
]


def test_bad_structured_output_and_tool_fields_are_400_naming_them():
    async def go():
        engine = FakeEngine()
        answers = []
        async with raw_api(engine) as client:
            for endpoint, fields, _param in BAD:
                path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
                body = {"messages": CHAT} if endpoint == "chat" else {"prompt": "x"}
                resp = await client.post(path, json={**body, **fields})
                answers.append((resp.status, (await resp.json())["error"]["param"]))
        assert engine.requests == []
        return answers

    answers = run(go())
    assert answers == [(400, param) for _, _, param in BAD]


def test_a_refusal_through_the_openai_client():
    async def go():
        async with openai_api(FakeEngine()) as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="fake-model",
                    messages=CHAT,
                    tools=TOOLS,
                    tool_choice="required",
                    response_format={"type": "json_object"},
                )
        return info.value

    error = run(go())
    assert error.param == "tool_choice" and "response_format" in error.message


def test_an_engine_rejection_of_the_schema_names_its_field():
    """The tokenizer compiles the constraint and answers a bad one with a 400 naming its `param`."""

    async def go():
        engine = FakeEngine(reject=(400, "guided_regex: unclosed group", "guided_regex"))
        async with openai_api(engine) as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="fake-model", messages=CHAT, extra_body={"guided_regex": "(a"}
                )
        return info.value

    assert run(go()).param == "guided_regex"


# ------------------------------------------------------------------ tools, tool_choice, messages -> GenerateRequest


def test_tools_and_tool_choice_reach_the_engine():
    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            chat = client.chat.completions.create
            await chat(model="fake-model", messages=CHAT, tools=TOOLS)
            await chat(model="fake-model", messages=CHAT, tools=TOOLS, tool_choice="none")
            await chat(
                model="fake-model", messages=CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
            )
            await chat(
                model="fake-model",
                messages=CHAT,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
            )
            await chat(
                model="fake-model",
                messages=CHAT,
                tool_choice="none",
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            await chat(
                model="fake-model",
                messages=CHAT,
                tools=TOOLS,
                tool_choice="auto",
                response_format={"type": "json_object"},
            )  # not forced: allowed
        return engine.requests

    auto, none, required, named, plain, auto_json = run(go())
    functions = [
        ToolFunction(name="get_weather", description="Weather of a city", parameters=WEATHER),
        ToolFunction(name="get_time"),
    ]
    assert functions[1].parameters == {"type": "object", "properties": {}}
    assert (auto.tools, auto.tool_choice, auto.forced_tool) == (functions, "auto", None)
    assert (none.tools, none.tool_choice, none.forced_tool) == (functions, "none", None)
    assert (required.tools, required.tool_choice, required.forced_tool) == (functions, "required", None)
    assert (named.tools, named.tool_choice, named.forced_tool) == (functions, "required", "get_time")
    assert (plain.tools, plain.tool_choice, plain.chat_template_kwargs) == ([], "none", {"enable_thinking": False})
    assert auto.chat_template_kwargs == {} and auto.params.constraint is None
    assert auto_json.tool_choice == "auto" and auto_json.params.constraint.kind == "json_object"


def test_messages_with_tool_calls_and_tool_results_reach_the_engine():
    arguments = json.dumps({"city": "Paris"})
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": "Sunny at noon.", "tool_calls": []},
    ]

    async def go():
        engine = FakeEngine()
        async with openai_api(engine) as client:
            await client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)
        return engine.requests[0].messages

    assert run(go()) == [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[
                ToolCall(id="call_1", name="get_weather", arguments=arguments),
                ToolCall(id="call_2", name="get_time", arguments="{}"),
            ],
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
        ChatMessage(role="tool", content="noon", tool_call_id="call_2", name="get_time"),
        ChatMessage(role="assistant", content="Sunny at noon."),
    ]


# ------------------------------------------------------------------ tool-call parsing, whole and streamed

WEATHER_CALL = ("get_weather", {"city": "Paris"})
TIME_CALL = ("get_time", {})

# (engine text, engine finish ("stop": the tokens all fit, "length": cut), content, calls, finish_reason)
TOOL_OUTPUTS = {
    "hermes": (hermes(*WEATHER_CALL), "stop", None, [WEATHER_CALL], "tool_calls"),
    "hermes, two calls": (
        hermes(*WEATHER_CALL) + "\n" + hermes(*TIME_CALL),
        "stop",
        None,
        [WEATHER_CALL, TIME_CALL],
        "tool_calls",
    ),
    "hermes, tight": (
        '<tool_call>{"name":"get_time","arguments":{}}</tool_call>',
        "stop",
        None,
        [TIME_CALL],
        "tool_calls",
    ),
    "llama json": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "stop",
        None,
        [WEATHER_CALL],
        "tool_calls",
    ),
    "python tag": ('<|python_tag|>{"name": "get_time", "arguments": {}}', "stop", None, [TIME_CALL], "tool_calls"),
    "content and a call": (
        "Let me check.\n" + hermes(*WEATHER_CALL),
        "stop",
        "Let me check.\n",
        [WEATHER_CALL],
        "tool_calls",
    ),
    "call then content": (hermes(*TIME_CALL) + "\nDone <3", "stop", "\nDone <3", [TIME_CALL], "tool_calls"),
    "malformed block": (
        "<tool_call>{name: get_time}</tool_call>",
        "stop",
        "<tool_call>{name: get_time}</tool_call>",
        [],
        "stop",
    ),
    "unknown function": (
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "stop",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        [],
        "stop",
    ),
    "a good and a bad block": (
        hermes(*TIME_CALL) + '<tool_call>{"name": 1}</tool_call>',
        "stop",
        '<tool_call>{"name": 1}</tool_call>',
        [TIME_CALL],
        "tool_calls",
    ),
    "plain text": ("Hello <b>world</b>, a < b", "stop", "Hello <b>world</b>, a < b", [], "stop"),
    "a json answer": ('{"city": "Paris"}', "stop", '{"city": "Paris"}', [], "stop"),
    "cut off in a block": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        "length",
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        [],
        "length",
    ),
    "cut off after a call": (hermes(*TIME_CALL) + "\n<tool_call>{", "length", "\n<tool_call>{", [TIME_CALL], "length"),
    "cut off llama json": (
        '{"name": "get_weather", "parameters": {"ci',
        "length",
        '{"name": "get_weather", "parameters": {"ci',
        [],
        "length",
    ),
}


def fake_for(text: str, finish: str, size: int = 3) -> FakeEngine:
    tokens = pieces(text, size)
    if finish == "length":  # the fake engine says "length" when max_tokens cuts its tokens
        return FakeEngine(tokens + ["<never sent>"], max_context=4096)
    return FakeEngine(tokens, max_context=4096)


def calls_of(tool_calls) -> list:
    if not tool_calls:
        return []
    for call in tool_calls:
        assert CALL_ID_RE.fullmatch(call.id) and call.type == "function"
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("case", list(TOOL_OUTPUTS))
def test_tool_calls_in_whole_answers(case):
    text, finish, content, calls, finish_reason = TOOL_OUTPUTS[case]

    async def go():
        engine = fake_for(text, finish)
        async with openai_api(engine) as client:
            return await client.chat.completions.create(
                model="fake-model", messages=CHAT, tools=TOOLS, max_tokens=len(pieces(text))
            )

    out = run(go())
    (choice,) = out.choices
    assert choice.message.content == content
    assert calls_of(choice.message.tool_calls) == calls
    assert choice.finish_reason == finish_reason
    if calls:  # the arguments are JSON text that parses to the dict
        assert isinstance(choice.message.tool_calls[0].function.arguments, str)


def accumulate(chunks) -> dict:
    """A streamed choice 0 as a client accumulates it: content, reasoning, tool calls by index, finish."""
    out = {"content": None, "reasoning": None, "calls": {}, "finish": None}
    for chunk in chunks:
        (choice,) = chunk.choices
        delta = choice.delta
        if delta.content:
            out["content"] = (out["content"] or "") + delta.content
        reasoning = getattr(delta, "reasoning_content", None)
        if reasoning:
            out["reasoning"] = (out["reasoning"] or "") + reasoning
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or call.id
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        if choice.finish_reason is not None:
            assert out["finish"] is None
            out["finish"] = choice.finish_reason
    return out


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("case", list(TOOL_OUTPUTS))
def test_tool_calls_streamed(case, size):
    text, finish, content, calls, finish_reason = TOOL_OUTPUTS[case]

    async def go():
        engine = fake_for(text, finish, size)
        async with openai_api(engine) as client:
            stream = await client.chat.completions.create(
                model="fake-model", messages=CHAT, tools=TOOLS, stream=True, max_tokens=len(pieces(text, size))
            )
            return [chunk async for chunk in stream]

    got = accumulate(run(go()))
    assert got["content"] == content
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())] == calls
    assert sorted(got["calls"]) == list(range(len(calls)))
    assert all(CALL_ID_RE.fullmatch(c["id"]) for c in got["calls"].values())
    assert got["finish"] == finish_reason


def test_tool_call_stream_shape():
    text = "Sure." + hermes(*WEATHER_CALL)

    async def go():
        async with raw_api(FakeEngine(pieces(text))) as client:
            resp = await client.post("/v1/chat/completions", json={"messages": CHAT, "tools": TOOLS, "stream": True})
            return sse_events(await resp.text())

    events = run(go())
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    (call_delta,) = [d for d in deltas if "tool_calls" in d]
    (call,) = call_delta["tool_calls"]
    assert CALL_ID_RE.fullmatch(call["id"])
    assert call == {
        "index": 0,
        "id": call["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    assert "<" not in "".join(d.get("content", "") for d in deltas)  # the markup never leaked as content
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


def test_the_openai_stream_helper_accumulates_tool_calls():
    class Weather(pydantic.BaseModel):
        city: str

    text = "Checking." + hermes("Weather", {"city": "Paris"})

    async def go():
        engine = FakeEngine(pieces(text))
        async with openai_api(engine) as client:
            tools = [openai.pydantic_function_tool(Weather)]
            async with client.chat.completions.stream(model="fake-model", messages=CHAT, tools=tools) as stream:
                events = [event.type async for event in stream]
                streamed = await stream.get_final_completion()
            whole = await client.chat.completions.parse(model="fake-model", messages=CHAT, tools=tools)
        return events, streamed, whole, engine

    events, streamed, whole, engine = run(go())
    assert "tool_calls.function.arguments.done" in events
    assert engine.requests[0].tools[0].name == "Weather"
    for completion in (streamed, whole):
        (choice,) = completion.choices
        (call,) = choice.message.tool_calls
        assert call.function.name == "Weather" and call.function.parsed_arguments == Weather(city="Paris")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_text_is_content():
    text = hermes(*TIME_CALL)

    async def go():
        engine = FakeEngine(pieces(text))
        async with openai_api(engine) as client:
            plain = await client.chat.completions.create(model="fake-model", messages=CHAT)
            none = await client.chat.completions.create(
                model="fake-model", messages=CHAT, tools=TOOLS, tool_choice="none"
            )
        return plain, none

    for out in run(go()):
        assert out.choices[0].message.content == text and out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason == "stop"


def test_n_choices_parse_their_own_calls():
    texts = {"-0": pieces(hermes(*TIME_CALL)), "-1": pieces("No call needed.")}

    async def go():
        engine = FakeEngine(tokens_of=lambda r: texts[r.rid[r.rid.rindex("-") :]])
        async with openai_api(engine) as client:
            whole = await client.chat.completions.create(model="fake-model", messages=CHAT, tools=TOOLS, n=2)
            stream = await client.chat.completions.create(
                model="fake-model", messages=CHAT, tools=TOOLS, n=2, stream=True
            )
            chunks = [c async for c in stream]
        return whole, chunks

    whole, chunks = run(go())
    assert calls_of(whole.choices[0].message.tool_calls) == [TIME_CALL] and whole.choices[0].message.content is None
    assert whole.choices[1].message.content == "No call needed." and whole.choices[1].message.tool_calls is None
    assert [c.finish_reason for c in whole.choices] == ["tool_calls", "stop"]
    for index, (content, calls, finish) in enumerate(
        [(None, [TIME_CALL], "tool_calls"), ("No call needed.", [], "stop")]
    ):
        got = accumulate([c for c in chunks if c.choices[0].index == index])
        assert got["content"] == content and got["finish"] == finish
        assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == calls


def test_held_back_text_keeps_its_logprobs():
    text = "Hi <tool_call>" + json.dumps({"name": "get_time", "arguments": {}}) + "</tool_call>"
    tokens = pieces(text, 4)

    async def go():
        engine = FakeEngine(tokens)
        async with openai_api(engine) as client:
            stream = await client.chat.completions.create(
                model="fake-model", messages=CHAT, tools=TOOLS, stream=True, logprobs=True
            )
            return [c async for c in stream]

    chunks = run(go())
    sent = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert sent == tokens  # every token's logprob once, in order, though its text was held back


# ------------------------------------------------------------------ reasoning

# (text, engine finish, whole: (reasoning, content), streamed: (reasoning, content))
REASONING_OUTPUTS = {
    "think then answer": (
        "<think>\nParis is in France.\n</think>\n\nParis.",
        "stop",
        ("\nParis is in France.\n", "Paris."),
        ("\nParis is in France.\n", "Paris."),
    ),
    "leading space": ("  <think>hmm</think>Paris.", "stop", ("hmm", "Paris."), ("hmm", "Paris.")),
    "no thinking": ("Paris.", "stop", (None, "Paris."), (None, "Paris.")),
    # the template opened the block in the prompt: only whole answers can tell
    "closing tag only": (
        "It is Paris.</think>\nParis.",
        "stop",
        ("It is Paris.", "Paris."),
        (None, "It is Paris.</think>\nParis."),
    ),
    "cut off while thinking": ("<think>Paris is", "length", ("Paris is", ""), ("Paris is", None)),
    "a lone <": ("<3 Paris", "stop", (None, "<3 Paris"), (None, "<3 Paris")),
}


@pytest.mark.parametrize("case", list(REASONING_OUTPUTS))
def test_reasoning_whole_and_streamed(case):
    text, finish, (whole_reasoning, whole_content), (stream_reasoning, stream_content) = REASONING_OUTPUTS[case]

    async def go():
        results = []
        for stream in (False, True):
            engine = fake_for(text, finish, 2)
            async with openai_api(engine, reasoning="think") as client:
                out = await client.chat.completions.create(
                    model="fake-model", messages=CHAT, stream=stream, max_tokens=len(pieces(text, 2))
                )
                results.append([c async for c in out] if stream else out)
        return results

    whole, chunks = run(go())
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (whole_reasoning, whole_content)
    assert whole.choices[0].finish_reason == finish
    got = accumulate(chunks)
    assert (got["reasoning"], got["content"]) == (stream_reasoning, stream_content)
    assert got["finish"] == finish


def test_reasoning_then_a_tool_call():
    text = "<think>I need the weather.</think>\n\n" + hermes(*WEATHER_CALL)

    async def go():
        async with openai_api(FakeEngine(pieces(text)), reasoning="think") as client:
            whole = await client.chat.completions.create(model="fake-model", messages=CHAT, tools=TOOLS)
            stream = await client.chat.completions.create(model="fake-model", messages=CHAT, tools=TOOLS, stream=True)
            return whole, [c async for c in stream]

    whole, chunks = run(go())
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == "I need the weather." and message.content is None
    assert calls_of(message.tool_calls) == [WEATHER_CALL] and whole.choices[0].finish_reason == "tool_calls"
    got = accumulate(chunks)
    assert got["reasoning"] == "I need the weather." and got["content"] is None
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [WEATHER_CALL]
    assert got["finish"] == "tool_calls"


def test_reasoning_is_off_by_default():
    text = "<think>hmm</think>Paris."

    async def go():
        async with raw_api(FakeEngine(pieces(text))) as client:
            whole = await (await client.post("/v1/chat/completions", json={"messages": CHAT})).json()
            resp = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
            return whole, sse_events(await resp.text())

    whole, events = run(go())
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == text
    assert not any("reasoning_content" in d for d in deltas)


def test_reasoning_does_not_touch_completions():
    text = "<think>hmm</think>Paris."

    async def go():
        async with openai_api(FakeEngine(pieces(text)), reasoning="think") as client:
            return await client.completions.create(model="fake-model", prompt="x", max_tokens=50)

    assert run(go()).choices[0].text == text


# ------------------------------------------------------------------ the parser alone: streamed = whole

PARSER_TEXTS = [
    *(t for t, *_ in TOOL_OUTPUTS.values()),
    "  \n" + hermes(*TIME_CALL) + "\n",
    "\n\n",
    "",
    "a <tool_call> never closed",
    "<tool_call>" + hermes(*TIME_CALL),
    "<think>x</think>  " + hermes(*TIME_CALL) + " and <tool_call>{}</tool_call>",
    '<think>\n</think>\n\n{"name": "get_time", "arguments": {}}',
    "<thinking> is not a tag",
    "<|python_tag|> not json",
]


ANALYSIS = "<|channel|>analysis<|message|>The user wants Paris' weather.<|end|>"
HARMONY_TEXTS = [
    ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
    ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>',
    ANALYSIS + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",  # <|call|> a stop
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_time<|message|>{"tz": "CET"}<|call|>',
    ANALYSIS + "<|start|>assistant<|channel|>final<|message|>a <| b <|en",  # cut off by the length
    ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.unknown<|message|>{"x": 1}<|call|>',
    ANALYSIS + "<|start|>assist",  # a header cut off
    "<|channel|>analy",  # the first header cut off: nothing
    "no harmony at all",
]


@pytest.mark.parametrize(
    "text, reasoning", [(t, r) for t in PARSER_TEXTS for r in ("", "think")] + [(t, "harmony") for t in HARMONY_TEXTS]
)
def test_every_split_of_a_stream_gives_the_whole_answer(text, reasoning):
    names = frozenset({"get_weather", "get_time"})
    whole, whole_finish = parse_whole(text, "stop", tool_names=names, reasoning=reasoning)
    whole_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text), pieces(text, 5)]
    for split in splits:
        stream = ChatOutputStream(tool_names=names, reasoning=reasoning)
        deltas = [d for piece in split for d in stream.feed(piece)]
        rest, finish = stream.finish("stop")
        deltas += rest
        content = "".join(d.get("content", "") for d in deltas) if any("content" in d for d in deltas) else None
        reasoning_text = "".join(d.get("reasoning_content", "") for d in deltas) or None
        calls = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
        assert calls == whole_calls, split
        assert finish == whole_finish
        assert content == (whole["content"] or None), split
        if reasoning:
            assert reasoning_text == whole["reasoning_content"], split
