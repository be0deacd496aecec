"""OpenAI's Responses API (`/v1/responses`, issue 31) through the real `openai` package.

First against the fake engine: what each field becomes in the chat request the engine runs, the
response object and its streamed events, tool calls and reasoning as output items, the store behind
`previous_response_id` and GET/DELETE, and the 400s naming the Responses API's own fields. Then end
to end on a tiny random model (`batchserve serve`, five processes): greedy answers equal the same
conversation through chat completions, streamed and not, `responses.parse` held to a pydantic model by
grammar, and a function tool call round trip.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Literal

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine
from e2e_server import start_server
from pydantic import BaseModel, Field

from batchserve.procs.api.app import HANDLERS_KEY, create_app
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import ChatMessage, ToolCall, ToolFunction

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time"},
]


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


@asynccontextmanager
async def api(engine: FakeEngine, *, reasoning: ReasoningFormat = ""):
    app = create_app(engine, ServerConfig(), reasoning=reasoning)
    async with TestServer(app) as server:
        async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as client:
            yield client


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def hermes(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def events_of(client: openai.AsyncOpenAI, **fields) -> list:
    stream = await client.responses.create(model="fake-model", stream=True, **fields)
    return [event async for event in stream]


async def raw_stream(engine: FakeEngine, body: dict) -> str:
    async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
        resp = await client.post("/v1/responses", json={**body, "stream": True})
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        return await resp.text()


# ------------------------------------------------------------------ the request -> the engine's chat request


def test_text_input_and_instructions_become_a_chat_and_the_response_echoes_the_request():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            out = await client.responses.create(
                model="fake-model",
                input="hi there",
                instructions="Be brief.",
                max_output_tokens=10,
                temperature=0.5,
                top_p=0.9,
                metadata={"team": "a"},
                user="u1",
                extra_body={"stop": ["x"], "include_stop_str_in_output": True},
            )
        return out, engine.requests

    out, (request,) = run(go())
    # vLLM's sampling extras reach the engine by name, as chat takes them
    assert (request.params.stop.stop, request.params.stop.include_stop_str_in_output) == (("x",), True)
    assert request.messages == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="hi there"),
    ]
    assert (request.params.stop.max_tokens, request.max_tokens_param) == (10, "max_output_tokens")
    assert (request.params.sampling.temperature, request.params.sampling.top_p) == (0.5, 0.9)
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    assert out.output_text == "Hello, world!"
    (message,) = out.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert [(p.type, p.text) for p in message.content] == [("output_text", "Hello, world!")]
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (4, 4, 8)
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert (out.instructions, out.max_output_tokens, out.temperature, out.top_p) == ("Be brief.", 10, 0.5, 0.9)
    assert (out.metadata, out.user, out.store, out.tool_choice, out.tools) == ({"team": "a"}, "u1", True, "auto", [])
    assert out.incomplete_details is None and out.error is None and out.model == "fake-model"


def test_message_items_calls_and_call_outputs_become_chat_messages():
    arguments = json.dumps({"city": "Paris"})
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"},
    ]

    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            await client.responses.create(model="fake-model", input=items, tools=TOOLS)
        return engine.requests[0]

    request = run(go())
    assert request.messages == [
        ChatMessage(role="system", content="Use tools."),
        ChatMessage(role="user", content="Weather\nin Paris?"),  # text parts joined as chat joins them
        ChatMessage(
            role="assistant",
            content="Let me look.",
            tool_calls=[
                ToolCall(id="call_1", name="get_weather", arguments=arguments),
                ToolCall(id="call_2", name="get_time", arguments="{}"),
            ],
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1", name="get_weather"),
        ChatMessage(role="tool", content="noon", tool_call_id="call_2", name="get_time"),
        ChatMessage(
            role="assistant", content=None, tool_calls=[ToolCall(id="call_3", name="get_time", arguments="{}")]
        ),
    ]
    assert request.tools == [
        ToolFunction(name="get_weather", description="Weather of a city", parameters=WEATHER),
        ToolFunction(name="get_time"),
    ]


def test_tool_choice_text_format_and_extras_reach_the_engine():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            create = client.responses.create
            await create(model="fake-model", input="x", tools=TOOLS, tool_choice="required")
            await create(
                model="fake-model", input="x", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"}
            )
            await create(model="fake-model", input="x", tools=TOOLS, tool_choice="none")
            await create(
                model="fake-model",
                input="x",
                text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
            )
            await create(model="fake-model", input="x", text={"format": {"type": "json_object"}})
            await create(
                model="fake-model",
                input="x",
                text={"format": {"type": "text"}},
                reasoning={"effort": "low"},
                extra_body={"seed": 7, "top_k": 5, "stop": ["w9"], "chat_template_kwargs": {"a": 1}},
            )
        return engine.requests

    required, named, none, json_schema, json_object, plain = run(go())
    assert (required.tool_choice, required.forced_tool) == ("required", None)
    assert (named.tool_choice, named.forced_tool) == ("required", "get_time")
    assert none.tool_choice == "none"
    assert (json_schema.params.constraint.kind, json_schema.params.constraint.param) == ("json_schema", "text.format")
    assert json.loads(json_schema.params.constraint.spec) == schema
    assert (json_object.params.constraint.kind, json_object.params.constraint.param) == ("json_object", "text.format")
    assert plain.params.constraint is None
    assert (plain.params.sampling.seed, plain.params.sampling.top_k, plain.params.stop.stop) == (7, 5, ("w9",))
    assert plain.chat_template_kwargs == {"a": 1, "reasoning_effort": "low"}  # as vLLM passes the effort


# ------------------------------------------------------------------ output items and events


def test_a_tool_call_answer_is_a_function_call_item_whole_and_streamed():
    text = "Sure. " + hermes("get_weather", {"city": "Paris"})

    async def go():
        async with api(FakeEngine(pieces(text))) as client:
            whole = await client.responses.create(model="fake-model", input="weather?", tools=TOOLS)
            events = await events_of(client, input="weather?", tools=TOOLS)
        return whole, events

    whole, events = run(go())
    assert whole.status == "completed"
    message, call = whole.output
    assert message.type == "message" and message.content[0].text == "Sure. "
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["message", "function_call"] and final.output_text == "Sure. "
    assert final.output[1].name == "get_weather" and final.output[1].id == done[0].item_id


def test_an_answer_of_calls_only_has_no_message_item():
    text = hermes("get_time", {})

    async def go():
        async with api(FakeEngine(pieces(text))) as client:
            whole = await client.responses.create(
                model="fake-model", input="time?", tools=TOOLS, tool_choice="required"
            )
            events = await events_of(client, input="time?", tools=TOOLS, tool_choice="required")
        return whole, events

    whole, events = run(go())
    assert [i.type for i in whole.output] == ["function_call"] and whole.output_text == ""
    assert [i.type for i in events[-1].response.output] == ["function_call"]


def test_a_thinking_model_answers_with_a_reasoning_item():
    text = "<think>Paris is in France.</think>\n\nParis."

    async def go():
        async with api(FakeEngine(pieces(text, 4)), reasoning="think") as client:
            whole = await client.responses.create(model="fake-model", input="capital?")
            events = await events_of(client, input="capital?")
        return whole, events

    whole, events = run(go())
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris is in France."
    assert message.content[0].text == "Paris." and whole.output_text == "Paris."
    # the deltas up to and including the one that closes </think>: 9 of 11
    assert whole.usage.output_tokens_details.reasoning_tokens == 9
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta"
    )
    streamed = events[-1].response
    assert [i.type for i in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].content[0].text == "Paris is in France." and streamed.output_text == "Paris."
    assert streamed.usage.output_tokens_details.reasoning_tokens == 9


def test_stream_events_in_order_with_sequence_numbers_and_no_done():
    text = run(raw_stream(FakeEngine(), {"input": "hi"}))
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and "[DONE]" not in text
    events = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello, world!"
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2] if "item_id" in e)
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello, world!"
    assert final["usage"]["output_tokens"] == 4


def test_the_sdk_stream_helper_and_max_output_tokens_cut_is_incomplete():
    async def go():
        async with api(FakeEngine()) as client:
            async with client.responses.stream(model="fake-model", input="hi") as stream:
                final = await stream.get_final_response()
            cut = await client.responses.create(model="fake-model", input="hi", max_output_tokens=2)
            cut_events = await events_of(client, input="hi", max_output_tokens=2)
        return final, cut, cut_events

    final, cut, cut_events = run(go())
    assert final.output_text == "Hello, world!" and final.status == "completed"
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "Hello," and cut.output[0].status == "incomplete"
    assert cut_events[-1].type == "response.incomplete"  # as OpenAI ends a cut stream
    assert cut_events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_logprobs_when_included():
    async def go():
        async with api(FakeEngine()) as client:
            whole = await client.responses.create(
                model="fake-model", input="hi", top_logprobs=2, include=["message.output_text.logprobs"]
            )
            events = await events_of(client, input="hi", top_logprobs=2, include=["message.output_text.logprobs"])
        return whole, events

    whole, events = run(go())
    logprobs = whole.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [
        ("Hello", -0.25),
        (",", -0.5),
        (" world", -0.75),
        ("!", -1.0),
    ]
    assert [len(lp.top_logprobs) for lp in logprobs] == [2, 2, 2, 2] and logprobs[0].bytes == list(b"Hello")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[lp.token for lp in e.logprobs] for e in deltas] == [["Hello"], [","], [" world"], ["!"]]


def test_an_engine_failure_mid_stream_ends_with_error_and_response_failed():
    async def go():
        engine = FakeEngine(fail_after=2)
        async with api(engine) as client:
            return await events_of(client, input="hi"), engine

    events, engine = run(go())
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "the worker process exited"
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"


def test_a_client_gone_mid_stream_is_aborted_once_and_not_stored():
    async def go():
        engine = FakeEngine(["tok"] * 100, delay=0.02)
        app = create_app(engine, ServerConfig(responses_store="memory"))
        async with TestServer(app) as server:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            body = json.dumps({"input": "x", "stream": True}).encode()
            writer.write(
                f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await reader.readuntil(b"response.output_text.delta")  # a token is out
            writer.close()
            await writer.wait_closed()
            await asyncio.wait_for(engine.aborted.wait(), 5)
            await asyncio.sleep(0.2)  # an extra (wrong) abort would land meanwhile
            return engine, len(app[HANDLERS_KEY].responses.store)

    engine, stored = run(go())
    (request,) = engine.requests
    assert engine.aborts == [request.rid] and engine.closed == [request.rid]
    assert stored == 0


def test_an_engine_rejection_names_input():
    async def go():
        engine = FakeEngine(reject=(400, "This model's maximum context length is 128 tokens", "messages"))
        async with api(engine) as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(model="fake-model", input="hi")
        return info.value

    assert run(go()).param == "input"


# ------------------------------------------------------------------ stored responses


def test_previous_response_id_continues_the_conversation_and_get_and_delete_work():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            first = await client.responses.create(model="fake-model", input="w5", instructions="Be brief.")
            second = await client.responses.create(model="fake-model", input="w6", previous_response_id=first.id)
            streamed = [
                e
                async for e in await client.responses.create(
                    model="fake-model", input="w7", previous_response_id=second.id, stream=True
                )
            ]
            third = await client.responses.retrieve(streamed[-1].response.id)
            fourth = await client.responses.create(
                model="fake-model", input="w8", previous_response_id=third.id, store=False
            )
            with pytest.raises(openai.BadRequestError) as unstored:
                await client.responses.create(model="fake-model", input="w9", previous_response_id=fourth.id)
            got = await client.responses.retrieve(first.id)
            await client.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(fourth.id)
        return engine.requests, first, second, third, got, unstored.value

    requests, first, second, third, got, unstored = run(go())
    answer = ChatMessage(role="assistant", content="Hello, world!")
    assert requests[1].messages == [
        ChatMessage(role="user", content="w5"),
        answer,
        ChatMessage(role="user", content="w6"),
    ]  # instructions are not carried over
    assert requests[3].messages == [
        ChatMessage(role="user", content="w5"),
        answer,
        ChatMessage(role="user", content="w6"),
        answer,
        ChatMessage(role="user", content="w7"),
        answer,
        ChatMessage(role="user", content="w8"),
    ]
    assert second.previous_response_id == first.id and third.previous_response_id == second.id
    assert got.model_dump() == first.model_dump()
    assert (unstored.param, unstored.code) == ("previous_response_id", "previous_response_not_found")


def test_input_items_carry_over_but_instructions_do_not():
    async def go():
        engine = FakeEngine()
        async with api(engine) as client:
            first = await client.responses.create(
                model="fake-model",
                instructions="Be brief.",
                input=[{"role": "developer", "content": "Speak French."}, {"role": "user", "content": "w5"}],
            )
            await client.responses.create(
                model="fake-model", input="w6", previous_response_id=first.id, instructions="Be long."
            )
        return engine.requests[1].messages

    assert run(go()) == [
        ChatMessage(role="system", content="Be long."),
        ChatMessage(role="system", content="Speak French."),
        ChatMessage(role="user", content="w5"),
        ChatMessage(role="assistant", content="Hello, world!"),
        ChatMessage(role="user", content="w6"),
    ]


def test_a_stored_call_continues_with_its_output():
    async def go():
        engine = FakeEngine(tokens_of=lambda r: pieces(hermes("get_time", {})) if len(r.messages) == 1 else ["noon"])
        async with api(engine) as client:
            asked = await client.responses.create(model="fake-model", input="time?", tools=TOOLS)
            (call,) = asked.output
            answer = await client.responses.create(
                model="fake-model",
                previous_response_id=asked.id,
                tools=TOOLS,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
            )
        return engine.requests[1].messages, call, answer

    messages, call, answer = run(go())
    assert messages == [
        ChatMessage(role="user", content="time?"),
        ChatMessage(
            role="assistant", content=None, tool_calls=[ToolCall(id=call.call_id, name="get_time", arguments="{}")]
        ),
        ChatMessage(role="tool", content="12:00", tool_call_id=call.call_id, name="get_time"),
    ]
    assert answer.output_text == "noon"


# ------------------------------------------------------------------ 400s naming the field

BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
        "input[0].content[0].type",
    ),
    (
        {"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[1].call_id",
    ),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "xx"}]}, "input[0].encrypted_content"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}, "input[1].role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"max_output_tokens": "ten"}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools[1].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools[0].parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "A"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "A", "schema": [1]}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),  # a value of a mapping: named by the mapping
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 30, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"n": 2}, "n"),
    ({"max_tokens": 10}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"store": "no"}, "store"),
    ({"min_tokens": 5, "max_output_tokens": 2}, "min_tokens"),
]


def test_bad_inputs_are_400_naming_the_field():
    async def go():
        engine = FakeEngine()
        answers = []
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            for fields, _ in BAD:
                resp = await client.post("/v1/responses", json={"input": "hi", **fields})
                error = (await resp.json()).get("error") or {}
                answers.append((resp.status, error.get("param"), error.get("message")))
        return engine.requests, answers

    requests, answers = run(go())
    wrong = [
        (fields, status, param, message)
        for (fields, expected), (status, param, message) in zip(BAD, answers)
        if (status, param) != (400, expected)
    ]
    assert wrong == []
    # The api refuses all but max_output_tokens (its range, the context) and min_tokens against it, which
    # the tokenizer settles (the fake engine as the tokenizer does): those reach the engine, refused there.
    assert sorted(r.params.stop.max_tokens for r in requests) == [0, 2, 100_000], requests
    assert {r.max_tokens_param for r in requests} == {"max_output_tokens"}
    messages = dict(zip([p for _, p in BAD], [m for _, _, m in answers]))
    assert "max_completion_tokens" not in messages["max_output_tokens"]  # chat's names never show
    assert "function" not in messages["tools[0].name"].split("tools[0].name")[0]


def test_the_missing_input_case_is_sent_without_input():
    async def go():
        async with TestClient(TestServer(create_app(FakeEngine(), ServerConfig()))) as client:
            resp = await client.post("/v1/responses", json={"model": "fake-model"})
            return resp.status, (await resp.json())["error"]["param"]

    assert run(go()) == (400, "input")


def test_unknown_model_is_404_and_unknown_ids_are_404():
    async def go():
        async with api(FakeEngine()) as client:
            with pytest.raises(openai.NotFoundError) as model:
                await client.responses.create(model="gpt-x", input="hi")
            with pytest.raises(openai.NotFoundError):
                await client.responses.delete("resp_nope")
        return model.value

    error = run(go())
    assert error.code == "model_not_found" and error.param == "model"


# ------------------------------------------------------------------ end to end on a tiny model

E2E_TOKENS = 24


class Reply(BaseModel):
    ok: bool
    colour: Literal["red", "green"]
    word: str = Field(max_length=8)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server(
        model,
        tmp_path_factory.mktemp("responses") / "serve.log",
        "--kv-capacity-tokens",
        "8192",
        "--max-running-requests",
        "8",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, model, messages: list[dict], **fields) -> str:
    out = client.chat.completions.create(
        model=str(model), messages=messages, temperature=0, max_completion_tokens=E2E_TOKENS, **fields
    )
    return out.choices[0].message.content


def test_greedy_answers_equal_chat_completions_whole_and_streamed(client, model):
    question = "the quick brown fox"
    cases = [
        ({"input": question}, [{"role": "user", "content": question}]),
        (
            {"input": question, "instructions": "answer as JSON"},
            [{"role": "system", "content": "answer as JSON"}, {"role": "user", "content": question}],
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": question}]},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "the lazy dog"},
                ]
            },
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "the lazy dog"},
            ],
        ),
    ]
    for fields, messages in cases:
        expected = chat_text(client, model, messages)
        whole = client.responses.create(model=str(model), temperature=0, max_output_tokens=E2E_TOKENS, **fields)
        assert whole.output_text == expected, fields
        events = list(
            client.responses.create(
                model=str(model), temperature=0, max_output_tokens=E2E_TOKENS, stream=True, **fields
            )
        )
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == expected
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
        assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
        assert events[-1].response.usage.input_tokens == whole.usage.input_tokens


def test_max_output_tokens_makes_an_incomplete_response(client, model):
    out = client.responses.create(
        model=str(model), input="the quick brown fox", max_output_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3


def test_parse_with_a_pydantic_model_is_held_to_its_schema(client, model):
    done = client.responses.parse(
        model=str(model),
        input='{"name": "Ada", "age": 36, "ok": true}',
        text_format=Reply,
        temperature=0,
        max_output_tokens=80,
    )
    assert done.status == "completed"
    assert isinstance(done.output_parsed, Reply)  # pydantic validated the grammar's output
    assert Reply.model_validate_json(done.output_text) == done.output_parsed


def test_a_function_call_round_trip(client, model):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
    question = [{"role": "user", "content": "the quick brown fox"}]
    asked = client.responses.create(
        model=str(model), input=question, tools=tools, tool_choice="required", max_output_tokens=80, temperature=0
    )
    calls = [item for item in asked.output if item.type == "function_call"]
    assert asked.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}
    # the client keeps the conversation ...
    follow_up = client.responses.create(
        model=str(model),
        input=[*question, *asked.output, result],
        tools=tools,
        tool_choice="none",
        max_output_tokens=E2E_TOKENS,
        temperature=0,
    )
    # ... or the server does
    stored = client.responses.create(
        model=str(model),
        previous_response_id=asked.id,
        input=[result],
        tools=tools,
        tool_choice="none",
        max_output_tokens=E2E_TOKENS,
        temperature=0,
    )
    assert follow_up.output_text == stored.output_text
    expected = chat_text(
        client,
        model,
        [
            *question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}],
        tool_choice="none",
    )
    assert follow_up.output_text == expected
    assert client.responses.retrieve(stored.id).output_text == stored.output_text


def test_errors_from_the_engine_name_the_responses_fields(client, model):
    with pytest.raises(openai.BadRequestError) as bad_schema:
        client.responses.create(
            model=str(model),
            input="x",
            text={
                "format": {
                    "type": "json_schema",
                    "name": "A",
                    "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                }
            },
        )
    assert bad_schema.value.param == "text.format"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.responses.create(model=str(model), input="the quick brown fox " * 600)
    assert too_long.value.param == "input"
