"""Limits on hostile bodies (issue 31): stop sequences, grammar sizes and repetition bounds, and prompts
too long for the context refused before (or early in) tokenization.

Through the app on the fake engine for every limit, through a real server with the `openai` package
for a limit and the size check, and on real tokenizers for the bound the tokenizer's early refusal
rests on (no prompt that fits is ever refused).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from api_fake_engine import FakeEngine
from test_api_app import api

from batchserve.procs.tokenizer import prompts as prompts_module
from batchserve.procs.tokenizer.prompts import PromptTokenizer
from batchserve.shared.checks import (
    MAX_GRAMMAR_CHARS,
    MAX_NESTED_REPEAT,
    MAX_REGEX_CHARS,
    MAX_REGEX_REPEAT,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    max_prompt_chars,
    max_token_chars,
)
from batchserve.shared.config import DEFAULT_MODEL
from batchserve.shared.errors import Refusal
from batchserve.shared.grammar import check_json_schema, check_lark, check_regex
from batchserve.shared.messages import ChatMessage, GenerateRequest, RequestParams, StopParams

NESTED = "((a{1,1000}){1,1000}){1,1000}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def post(engine: FakeEngine, path: str, body: dict) -> tuple[int, dict]:
    async with api(engine) as client:
        resp = await client.post(path, json=body)
        return resp.status, await resp.json()


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def refused(body: dict, param: str, path: str = "/v1/chat/completions", engine: FakeEngine | None = None) -> str:
    engine = engine or FakeEngine()
    status, answer = run(post(engine, path, body))
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert engine.requests == []  # refused in the api: nothing reached the engine
    return answer["error"]["message"]


def accepted(body: dict, path: str = "/v1/chat/completions", engine: FakeEngine | None = None) -> FakeEngine:
    engine = engine or FakeEngine()
    status, answer = run(post(engine, path, body))
    assert status == 200, answer
    return engine


# ---- stop sequences


def test_stop_count_and_length_limits():
    assert "length <= 32" in refused(chat(stop=[f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]), "stop")
    engine = accepted(chat(stop=[f"s{i}" for i in range(MAX_STOP_SEQUENCES)]))
    assert len(engine.requests[0].params.stop.stop) == MAX_STOP_SEQUENCES
    assert "length <= 512" in refused(chat(stop="x" * (MAX_STOP_CHARS + 1)), "stop")
    accepted(chat(stop=["x" * MAX_STOP_CHARS]))
    refused({"prompt": "hi", "stop": ["ok", "y" * 100_000]}, "stop[1]", "/v1/completions")
    refused(chat(stop=["a", ""]), "stop[1]")
    refused(chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids")
    accepted(chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))))


# ---- grammars: size and repetition bounds, refused before compilation


def test_regex_repetition_bounds_are_refused_naming_the_field():
    assert "at most 10000" in refused(chat(guided_regex="a{1000000000}"), "guided_regex")
    assert f"at most {MAX_NESTED_REPEAT}" in refused(chat(guided_regex=NESTED), "guided_regex")
    refused({"prompt": "x", "guided_regex": "(a{1,100}){1,100}"}, "guided_regex", "/v1/completions")
    refused(chat(guided_regex="a" * (MAX_REGEX_CHARS + 1)), "guided_regex")
    refused(chat(guided_regex="(" * 3000 + "a" + ")" * 3000), "guided_regex")  # nesting depth
    engine = accepted(chat(guided_regex="(a{1,40}){1,50}"))  # a product of 2000 is allowed
    assert engine.requests[0].params.constraint.spec == "(a{1,40}){1,50}"
    accepted(chat(guided_regex=r"[a-z]{1,100}@[a-z]{1,100}\.com"))  # side by side, not nested
    accepted(chat(guided_regex=r"\p{L}{1,20}(?<tail>x)"))  # llguidance's (Rust's) syntax is read too


def test_schema_and_grammar_limits_name_their_field():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": NESTED}}}
    refused(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), "response_format"
    )
    refused(chat(guided_json=schema), "guided_json")
    refused(chat(guided_json={"type": "object", "patternProperties": {"b{99999}": {}}}), "guided_json")
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_GRAMMAR_CHARS // 20)}}
    assert "131072 characters" in refused(chat(guided_json=big), "guided_json")
    refused(chat(guided_grammar=f"start: /{NESTED}/"), "guided_grammar")
    refused(chat(guided_grammar=f'start: "a"~{MAX_REGEX_REPEAT + 1}'), "guided_grammar")
    refused(
        chat(guided_grammar="start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_CHARS // 6))), "guided_grammar"
    )
    accepted(chat(guided_grammar='start: "a"~3 /[0-9]{1,5}/'))
    accepted(chat(guided_json={"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}))


def test_a_forced_tool_schema_is_checked_an_offered_one_is_not():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"z": {"type": "string", "pattern": NESTED}}},
            },
        }
    ]
    refused(chat(tools=tools, tool_choice="required"), "tools[0].function.parameters")
    refused(
        chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}), "tools[0].function.parameters"
    )
    accepted(chat(tools=tools))  # tool_choice auto: nothing is compiled from it


def test_the_shared_checks_directly():
    for ok in ["(a{1,2}){1,1000}", "(a+){1,2000}", r"\d{3}-\d{4}", "a{10000}", "(?i)ab", "a(?i)b", r"x\z"]:
        check_regex(ok, "p")
    for bad in ["(a{3}){1,1000}", "a{10001}", "((a{2}){2}){600}", "[", "a{3,2}"]:
        with pytest.raises(Refusal) as info:
            check_regex(bad, "p")
        assert info.value.param == "p"
    with pytest.raises(Refusal):
        check_json_schema(json.dumps({"items": [{"anyOf": [{"pattern": NESTED}]}]}), "guided_json")
    with pytest.raises(Refusal):
        check_lark("start: A\nA: /(x{1,50}){1,50}/", "guided_grammar")


# ---- the size check before tokenization (the api) ...


def test_a_prompt_whose_length_proves_it_cannot_fit_never_reaches_the_engine():
    limit = 1000
    engine = FakeEngine(max_prompt_chars=limit)
    status, body = run(post(engine, "/v1/completions", {"prompt": "a" * (limit + 1)}))
    assert status == 400 and body["error"]["param"] == "prompt" and "maximum context length" in body["error"]["message"]
    status, body = run(post(engine, "/v1/completions", {"prompt": ["short", "b" * (limit + 1)]}))
    assert status == 400 and body["error"]["param"] == "prompt[1]"
    assert run(post(engine, "/v1/completions", {"prompt": "a" * limit, "max_tokens": 1}))[0] == 200
    status, body = run(
        post(
            engine,
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "u" * 401}]},
        )
    )
    assert status == 400 and body["error"]["param"] == "messages"
    # assistant turns are not counted: a template may leave parts of them out
    status, _ = run(
        post(
            engine,
            "/v1/chat/completions",
            {
                "max_tokens": 1,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "x" * 5000},
                    {"role": "user", "content": "again"},
                ],
            },
        )
    )
    assert status == 200


def test_the_character_bound_of_tokenizers():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    def spec(model, normalizer=None, pre_tokenizer=None) -> str:
        tokenizer = Tokenizer(model)
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        if pre_tokenizer is not None:
            tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.add_special_tokens(["<|a_long_special_token|>"])
        return tokenizer.to_str()

    vocab = {"a": 0, "b": 1, "ab": 2, "abab": 3}
    bpe = models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "ab")])
    assert max_token_chars(spec(bpe, pre_tokenizer=pre_tokenizers.ByteLevel())) == len("<|a_long_special_token|>")
    bpe = models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "ab")])
    assert max_token_chars(spec(bpe, normalizers.NFC())) == 4 * len("<|a_long_special_token|>")
    # normalizers and pre-tokenizers that drop text, a fused unknown run, other models: no bound
    for normalizer, pre_tokenizer in [
        (normalizers.Strip(), None),
        (normalizers.BertNormalizer(), None),
        (None, pre_tokenizers.WhitespaceSplit()),
    ]:
        bpe = models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "ab")])
        assert max_token_chars(spec(bpe, normalizer, pre_tokenizer)) is None
    assert max_token_chars(spec(models.BPE(vocab=vocab, merges=[], unk_token="a", fuse_unk=True))) is None
    assert max_token_chars(spec(models.WordLevel(vocab=vocab, unk_token="a"))) is None
    assert max_prompt_chars(8192, 81) == 8191 * 81 and max_prompt_chars(8192, None) is None


# ---- ... and the tokenizer's early refusal


@pytest.fixture(scope="module")
def default_tokenizer():
    from batchserve.shared.model import ModelSpec

    return ModelSpec.resolve(DEFAULT_MODEL).load_tokenizer()


def prose(words: list[str], rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        word = rng.choice(words)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


def test_a_10_mb_prompt_is_refused_after_tokenizing_a_piece(default_tokenizer, monkeypatch):
    prompts = PromptTokenizer(default_tokenizer, 8192)
    assert prompts.max_prompt_chars == 8191 * 81  # SmolLM2's longest token: 81 characters
    encoded: list[int] = []
    encode = default_tokenizer.encode
    monkeypatch.setattr(default_tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    words = open(prompts_module.__file__).read().split()
    text = prose(words, random.Random(0), 10_000_000)
    with pytest.raises(Refusal) as info:
        prompts.tokenize(GenerateRequest(rid="r", prompt=text))
    assert info.value.param == "prompt" and encoded == []  # the length alone proves it
    with pytest.raises(Refusal) as info:  # under the character bound: refused after a piece or two
        prompts.tokenize(GenerateRequest(rid="r", messages=[ChatMessage(role="user", content=text[:600_000])]))
    assert info.value.param == "messages" and 0 < sum(encoded) <= 3 * 8 * 8192
    encoded.clear()
    fits = prose(words, random.Random(1), 20_000)  # about 6000 tokens
    ids = prompts.tokenize(GenerateRequest(rid="r", prompt=fits, params=RequestParams(stop=StopParams(max_tokens=1))))
    assert list(ids.prompt_ids) == encode(fits) and encoded == [len(fits)]


@pytest.mark.parametrize("which", ["default", "bytes"])
def test_no_prompt_that_fits_is_refused_by_the_piecewise_count(which, default_tokenizer, tiny_model_dir, monkeypatch):
    """The measurement behind the piecewise count: on prose near the context (small pieces, so that
    every text is counted in many pieces), a refusal only ever comes for a text whose whole
    tokenization does not fit, and an accepted text's ids are those of tokenizing it whole."""
    from batchserve.shared.model import load_tokenizer

    tokenizer = (
        default_tokenizer if which == "default" else load_tokenizer(tiny_model_dir("llama", with_tokenizer="bytes"))
    )
    monkeypatch.setattr(prompts_module, "PIECE_CHARS_PER_TOKEN", 1)  # pieces of `context` characters
    rng = random.Random(7)
    words = open(prompts_module.__file__).read().split() + ["naïve", "Ünïcode", "漢字", "-", "3.14", "it's"]
    refusals = 0
    for trial in range(60):
        context = rng.choice([64, 128, 256])
        prompts = PromptTokenizer(tokenizer, context)
        text = prose(words, rng, rng.randint(2 * context + 1, 8 * context))
        whole = tokenizer.encode(text, add_special_tokens=False)
        try:
            ids = prompts._encode(text, False, "prompt")
        except Refusal:
            refusals += 1
            assert len(whole) >= context, (trial, len(whole), context)
        else:
            assert ids == whole
    assert refusals > 10  # and it does refuse early, not only in theory


# ---- through a real server, as clients call it


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from e2e_server import start_server

    model = tiny_model_dir("llama", with_tokenizer="bytes")
    srv = start_server(
        model,
        tmp_path_factory.mktemp("limits") / "serve.log",
        "--kv-capacity-tokens",
        "2048",
        "--max-running-requests",
        "4",
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_limits_through_the_openai_package(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=client.models.list().data[0].id, prompt="hi", max_tokens=2, stop=[f"s{i}" for i in range(40)]
        )
    assert info.value.status_code == 400 and info.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"guided_regex": NESTED},
        )
    assert info.value.body["param"] == "guided_regex"


def test_a_10_mb_prompt_gets_its_400_from_the_api_and_the_server_serves_on(client):
    import openai

    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hello world " * 850_000, max_tokens=2)
    assert info.value.body["param"] == "prompt" and "maximum context length" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "hello world " * 850_000}]
        )
    assert info.value.body["param"] == "messages"
    # near the limit and fitting: served (the tiny model's context is 512 tokens, its longest token 6
    # characters, so the api refuses texts of more than 511 * 6 characters)
    answer = client.completions.create(model=model, prompt="the quick brown fox " * 100, max_tokens=2)
    assert 400 < answer.usage.prompt_tokens < 512 and answer.usage.completion_tokens >= 1


def test_the_zmq_engine_client_refuses_a_long_prompt_without_sending_it(tmp_path):
    from batchserve.procs.api.engine_client_zmq import ZmqEngineClient
    from batchserve.shared.ipc import Endpoints

    async def go():
        engine = ZmqEngineClient(Endpoints.in_dir(tmp_path), "m", 512, max_prompt_chars=100)
        await engine.start()
        try:
            events = [e async for e in engine.generate(GenerateRequest(rid="r", prompt="x" * 101))]
            with pytest.raises(Refusal) as info:
                await engine.tokenize(
                    GenerateRequest(rid="t", messages=[ChatMessage(role="user", content="y" * 101)]),
                    add_special_tokens=None,
                    add_generation_prompt=True,
                    continue_final_message=False,
                    return_token_strs=False,
                )
        finally:
            await engine.close()
        return events, info.value

    events, refusal = run(go())
    assert [(e.status, e.param) for e in events] == [(400, "prompt")] and refusal.param == "messages"
