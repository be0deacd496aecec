"""Structured output and tool calls end to end, as users call them: the `openai` package against a real
`batchserve serve` of the default model (SmolLM2-135M-Instruct, whose chat template takes no tools,
so it gets Hermes-format tool instructions from us)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from e2e_server import start_server
from pydantic import BaseModel, Field

from batchserve.shared.config import DEFAULT_MODEL

pytestmark = pytest.mark.slow

SEEDS = 20


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=50_000_000)
    continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "string", "maxLength": 30}},
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        DEFAULT_MODEL,
        tmp_path_factory.mktemp("e2e-structured") / "serve.log",
        "--kv-capacity-tokens",
        "16384",
        "--max-running-requests",
        str(SEEDS),
        startup_timeout=600,
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def valid_weather_call(call) -> bool:
    args = json.loads(call.function.arguments)
    return (
        call.type == "function"
        and call.function.name == "get_weather"
        and set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and len(args["city"]) <= 30
        and args["unit"] in ("celsius", "fahrenheit")
    )


def test_parse_returns_a_valid_object_for_every_seed(server):
    from openai import AsyncOpenAI

    async def all_seeds():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Describe a large city as JSON."}]
        return await asyncio.gather(
            *(
                client.chat.completions.parse(
                    model=DEFAULT_MODEL,
                    messages=messages,
                    response_format=City,
                    temperature=1.0,
                    seed=seed,
                    max_tokens=120,
                )
                for seed in range(SEEDS)
            )
        )

    done = asyncio.run(all_seeds())
    parsed = [c.choices[0].message.parsed for c in done]
    assert all(isinstance(p, City) for p in parsed)  # pydantic validated each against the model
    assert all(c.choices[0].finish_reason == "stop" for c in done)
    assert len({p.model_dump_json() for p in parsed}) > 1  # sampled: the seeds differ


def test_json_object_and_regex_constraints(client):
    obj = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    date = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="Today's date is",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert date.choices[0].finish_reason == "stop"
    assert len(date.choices[0].text) == 11 and date.choices[0].text[5] == "-"


def test_required_and_named_tool_choice_give_calls_that_match_the_schema(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=QUESTION,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=choice,
            max_tokens=80,
            temperature=0,
        )
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        assert len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.id.startswith("call_")
        if choice != "required" or call.function.name == "get_weather":
            assert valid_weather_call(call)
        else:
            assert set(json.loads(call.function.arguments)) == {"zone"}


def test_a_streamed_tool_call_and_the_follow_up_turn(client):
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function is not None:
                    entry["name"] = delta.function.name or entry["name"]
                    entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    call = calls[0]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city", "unit"}

    follow_up = QUESTION + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=follow_up, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=30, temperature=0
    )
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None or answer.choices[0].message.tool_calls == []


def test_a_bad_schema_is_a_400_naming_response_format(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=QUESTION,
            max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        )
    assert info.value.status_code == 400 and info.value.body["param"] == "response_format"
