"""The OpenAPI document (`procs.api.openapi`): every route the application registers is in it, but for
the routes of the other runner; its request schemas are the structs' own (ranges included), narrowed to
what this server accepts (`openapi_rules`), so that a request it calls valid is answered and one the
server refuses it calls invalid (checked here request by request, and by Schemathesis in
tests/test_openapi_fuzz.py)."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import jsonschema_rs  # Schemathesis's JSON Schema engine
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.procs.api.openapi import DOCUMENT_KEY, OPERATIONS
from batchserve.procs.api.openapi_rules import TEMPLATE_RESERVED, decimal_below
from batchserve.procs.api.process import model_vocab_size
from batchserve.procs.tokenizer.prompts import CHAT_TEMPLATE_RESERVED
from batchserve.shared.config import ServerConfig
from batchserve.shared.pooling import PoolerConfig

EMBEDDER = PoolerConfig(pooling="mean", normalize=False, matryoshka=True, hidden_size=3)
CROSS_ENCODER = PoolerConfig(pooling="cls", normalize=False, kind="classify", activation="sigmoid")
VOCAB = 1000  # the fake engine's vocabulary
CONTEXT = 128  # and its context


def fetch(config: ServerConfig, pooler: PoolerConfig | None = None) -> tuple[dict, set[tuple[str, str]]]:
    async def go():
        app = create_app(FakeEngine(vocab_size=VOCAB, max_context=CONTEXT), config, pooler=pooler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/openapi.json")
            assert resp.status == 200 and resp.content_type == "application/json"
            routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
            return await resp.json(), routes

    return asyncio.run(go())


def documented(document: dict) -> set[tuple[str, str]]:
    return {(method, path) for path, entry in document["paths"].items() for method in entry}


GENERATION = {("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/v1/responses")}
POOLING = {("post", p) for p in ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank")}


def test_every_route_is_documented_but_the_other_runners():
    """A generating server registers the pooling routes only to refuse them (400 naming the runner), and
    the reverse: its document leaves them out."""
    for config in (ServerConfig(), ServerConfig(webui=False, enable_lora=True, enable_lora_runtime_updates=True)):
        document, routes = fetch(config)
        assert documented(document) == routes - POOLING
        assert routes <= {(op.method, op.path) for op in OPERATIONS}
    document, routes = fetch(ServerConfig(), EMBEDDER)
    assert documented(document) == routes - GENERATION
    document, routes = fetch(ServerConfig(), CROSS_ENCODER)  # a cross-encoder computes no embeddings
    assert documented(document) == routes - GENERATION - {("post", "/v1/embeddings")}


def test_request_schemas_carry_the_structs_ranges_and_the_servers_bounds():
    document, _ = fetch(ServerConfig())
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    max_tokens = chat["max_tokens"]["anyOf"][0]
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (1, CONTEXT - 1)  # a prompt has a token at least
    assert chat["model"] == {"anyOf": [{"enum": ["fake-model"]}, {"type": "null"}]}
    assert chat["temperature"]["anyOf"][0]["maximum"] == 2.0
    assert chat["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == VOCAB - 1
    assert schemas["DetokenizeBody"]["properties"]["tokens"]["items"]["maximum"] == VOCAB - 1
    assert chat["priority"]["anyOf"][0] == {"type": "integer", "const": 0}  # first come, first served
    completions = document["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    priority, _ = fetch(ServerConfig(scheduling_policy="priority"))
    assert priority["components"]["schemas"]["CompletionRequest"]["properties"]["priority"]["anyOf"][0]["maximum"]


def test_a_pooling_servers_request_schemas():
    document, _ = fetch(ServerConfig(), EMBEDDER)
    schemas = document["components"]["schemas"]
    assert "ChatCompletionRequest" not in schemas
    dimensions = schemas["EmbeddingsBody"]["properties"]["dimensions"]["anyOf"][0]
    assert (dimensions["minimum"], dimensions["maximum"]) == (1, 3)  # any cut of its 3 (matryoshka)
    cross, _ = fetch(ServerConfig(), CROSS_ENCODER)
    assert "EmbeddingsBody" not in cross["components"]["schemas"]


def test_logit_bias_keys_are_the_vocabularys_ids():
    for n in (1, 2, 9, 10, 11, 100, 316, 1000, 32000, 151936):
        pattern = re.compile(decimal_below(n))
        assert [i for i in range(n + 1200) if pattern.match(str(i))] == list(range(n)), n
        assert not pattern.match("01") and not pattern.match("")


def test_the_reserved_template_variables_are_the_tokenizers():
    assert TEMPLATE_RESERVED == CHAT_TEMPLATE_RESERVED


def test_the_document_follows_the_served_names():
    """Made again when a LoRA adapter is loaded or unloaded at run time."""

    async def go():
        app = create_app(FakeEngine(), ServerConfig(enable_lora=True))
        async with TestClient(TestServer(app)) as client:
            before = await (await client.get("/openapi.json")).json()
            app[DOCUMENT_KEY].served.load("adapter")
            after = await (await client.get("/openapi.json")).json()
        return [d["components"]["schemas"]["CompletionRequest"]["properties"]["model"] for d in (before, after)]

    before, after = asyncio.run(go())
    assert before["anyOf"][0]["enum"] == ["fake-model"] and after["anyOf"][0]["enum"] == ["fake-model", "adapter"]


USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]
# (path, body, the server accepts it): the document must call valid exactly those it accepts
CASES = [
    ("/v1/chat/completions", {"messages": USER}, True),
    ("/v1/chat/completions", {"messages": []}, False),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, False),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1"}]}, False),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}]}, True),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": []}]}, False),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, False),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2, "logprobs": True}, True),
    ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, False),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "auto"}, False),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": TOOLS}, True),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "none"}, True),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": TOOLS, "guided_regex": "a"}, False),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, False),
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, False),
    ("/v1/chat/completions", {"messages": USER, "functions": [], "function_call": "none"}, True),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, False),
    ("/v1/completions", {"prompt": "hi"}, True),
    ("/v1/completions", {"prompt": ""}, False),
    ("/v1/completions", {"prompt": []}, False),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, True),
    ("/v1/completions", {"prompt": [1, "a"]}, False),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, False),
    ("/v1/completions", {"prompt": "hi", "best_of": 1}, True),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, False),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, False),
    ("/tokenize", {"prompt": "hi"}, True),
    ("/tokenize", {"messages": USER}, True),
    ("/tokenize", {"prompt": "hi", "messages": USER}, False),
    ("/tokenize", {}, False),
    ("/tokenize", {"messages": USER, "continue_final_message": True, "add_generation_prompt": True}, False),
    ("/detokenize", {"tokens": [VOCAB - 1]}, True),
    ("/detokenize", {"tokens": [VOCAB]}, False),
    ("/v1/responses", {"input": "hi"}, True),
    ("/v1/responses", {"input": ""}, False),
    ("/v1/responses", {"input": [{"type": "reasoning"}]}, False),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}, {"type": "reasoning"}]}, True),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "", "output": "1"}]}, False),
    ("/v1/responses", {"input": "hi", "n": 2}, False),
    ("/v1/responses", {"input": "hi", "background": True}, False),
    ("/v1/responses", {"input": "hi", "top_logprobs": 2}, False),
    ("/v1/responses", {"input": "hi", "top_logprobs": 2, "include": ["message.output_text.logprobs"]}, True),
    ("/v1/responses", {"input": "hi", "include": ["reasoning.encrypted_content"]}, False),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "f"}}, False),
    ("/v1/responses", {"input": "hi", "text": {"verbosity": "low"}}, False),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, False),
    ("/v1/responses", {"input": "hi", "reasoning": {"summary": "auto"}}, False),
]


@pytest.mark.parametrize(("path", "body", "accepted"), CASES, ids=[f"{p} {b}" for p, b, _ in CASES])
def test_the_document_calls_valid_what_the_server_accepts(path, body, accepted):
    async def go():
        app = create_app(FakeEngine(vocab_size=VOCAB, max_context=CONTEXT), ServerConfig())
        async with TestClient(TestServer(app)) as client:
            document = await (await client.get("/openapi.json")).json()
            answer = await client.post(path, json=body)
            return document, answer.status, await answer.text()

    document, status, text = asyncio.run(go())
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]})
    assert (status == 200) is accepted, text
    assert validator.is_valid(body) is accepted


def test_the_document_leaves_out_what_only_the_engine_refuses():
    """Token ids outside the vocabulary, a priority this queue ignores, the template variables the server
    sets: the fake engine takes them, the tokenizer and the scheduler would not."""
    document, _ = fetch(ServerConfig())
    for path, body in [
        ("/v1/completions", {"prompt": [VOCAB]}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [VOCAB]}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}),
        ("/v1/completions", {"prompt": "hi", "priority": 1}),
        ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tools": []}}),
    ]:
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert not jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]}).is_valid(body)


def test_the_document_is_open_where_api_keys_guard_the_api():
    """As /health: a client reads the document before it has a key; /v1/ stays guarded."""

    async def go():
        async with TestClient(TestServer(create_app(FakeEngine(), ServerConfig(api_key="secret")))) as client:
            return (await client.get("/openapi.json")).status, (await client.get("/v1/models")).status

    assert asyncio.run(go()) == (200, 401)


def test_the_api_process_reads_the_vocabulary_size_from_the_model_folder(tmp_path):
    """tokenizer.json's own vocabulary, at most config.json's logits width; None without one."""
    spec = SimpleNamespace(model_dir=tmp_path, vocab_size=8)
    assert model_vocab_size(spec) is None
    vocab = {c: i for i, c in enumerate("abcde")}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    assert model_vocab_size(spec) == 5
    assert model_vocab_size(SimpleNamespace(model_dir=tmp_path, vocab_size=3)) == 3
