"""The api's OpenAPI 3.1 document, served at `/openapi.json`: this server's own.

Request bodies are the JSON Schemas of the same msgspec structs `decode_body` decodes with, ranges
included (`field_types`), so the document cannot drift from what is validated; then narrowed to what
this server accepts (`openapi_rules`): the served model names, token ids below the vocabulary size,
max_tokens within the context, the rules across fields, the fields refused unless neutral. Every route
the application registers has an entry in `OPERATIONS` (a test checks that), and the document lists
those this server answers: the generation routes on the generate runner, the pooling routes on the
pooling runner (/v1/embeddings with an embedding model), the web pages only with --webui; a route
registered on the other runner only to refuse is left out. Answers are described as far as clients
rely on them (the keys every answer carries); every error is an OpenAI error body. CI fuzzes the
document's operations against a running server with Schemathesis (tests/test_openapi_fuzz.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from importlib.metadata import version
from typing import Any

import msgspec
from aiohttp import web

from batchserve.procs.api.engine_client import EngineClient
from batchserve.procs.api.field_types import INT32_MAX
from batchserve.procs.api.openapi_more_rules import MORE_RULES
from batchserve.procs.api.openapi_rules import RULES, Schema, ServerFacts
from batchserve.procs.api.pooling_api import EmbeddingsBody, RerankBody, ScoreBody
from batchserve.procs.api.responses_request import ResponsesRequest
from batchserve.procs.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    LoadLoraBody,
    TokenizeBody,
    UnloadLoraBody,
)
from batchserve.procs.api.served_models import ServedModels
from batchserve.shared.config import ServerConfig, request_cap
from batchserve.shared.pooling import PoolerConfig

JSON, SSE, TEXT, HTML = "application/json", "text/event-stream", "text/plain", "text/html"
VERSION = version("batchserve")
GENERATE, POOLING, EMBED = ("generate",), ("embed", "classify"), ("embed",)  # the runners that answer


def _object(*required: str, **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": properties}


ERROR = _object("error", error=_object("message", "type", message={"type": "string"}, type={"type": "string"}))
_CHOICES = {"type": "array", "items": {"type": "object"}}
COMPLETION = _object("id", "object", "created", "model", "choices", choices=_CHOICES)
RESPONSE = _object("id", "object", "status", object={"const": "response"})
LIST = _object("object", "data", object={"const": "list"}, data={"type": "array"})
RANKED = _object("results")


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    body: type | None = None  # the msgspec struct of its JSON body
    answer: dict[str, Any] | None = None  # the 200 answer's JSON schema (None: `content` says)
    content: tuple[str, ...] = (JSON,)  # the 200 answer's media types
    tag: str = "openai"
    unavailable: dict[str, Any] | None = None  # a 503 answer of its own (not an error body)
    runners: tuple[str, ...] = (*GENERATE, *POOLING)  # the servers that answer it (`ServerFacts.runner`)


GENERATING = (JSON, SSE)  # `stream`: SSE, else JSON
OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "post",
        "/v1/completions",
        "A completion (streamed with `stream`)",
        CompletionRequest,
        COMPLETION,
        GENERATING,
        runners=GENERATE,
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "A chat completion",
        ChatCompletionRequest,
        COMPLETION,
        GENERATING,
        runners=GENERATE,
    ),
    Operation(
        "post",
        "/v1/responses",
        "A response (OpenAI's Responses API)",
        ResponsesRequest,
        RESPONSE,
        GENERATING,
        runners=GENERATE,
    ),
    Operation("get", "/v1/responses/{response_id}", "A stored response", answer=RESPONSE),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response", answer=_object("id", "deleted")),
    Operation("get", "/v1/models", "The served models", answer=LIST),
    Operation("post", "/v1/embeddings", "Embeddings (an embedding model)", EmbeddingsBody, LIST, runners=EMBED),
    Operation("post", "/v1/score", "Scores of text pairs", ScoreBody, LIST, runners=POOLING),
    Operation("post", "/score", "Scores of text pairs (vLLM's path)", ScoreBody, LIST, runners=POOLING),
    Operation("post", "/v1/rerank", "Documents reranked for a query", RerankBody, RANKED, runners=POOLING),
    Operation("post", "/rerank", "Reranking (vLLM's path)", RerankBody, RANKED, runners=POOLING),
    Operation("post", "/v2/rerank", "Reranking (Cohere's v2 path)", RerankBody, RANKED, runners=POOLING),
    Operation(
        "post", "/tokenize", "Token ids of a prompt or chat", TokenizeBody, _object("count", "tokens"), tag="vllm"
    ),
    Operation("post", "/detokenize", "The text of token ids", DetokenizeBody, _object("prompt"), tag="vllm"),
    Operation("post", "/v1/load_lora_adapter", "Load a LoRA adapter", LoadLoraBody, content=(TEXT,), tag="vllm"),
    Operation("post", "/v1/unload_lora_adapter", "Unload a LoRA adapter", UnloadLoraBody, content=(TEXT,), tag="vllm"),
    Operation(
        "get",
        "/health",
        "Ready to serve (503 with the reason when not)",
        answer=_object("status"),
        tag="server",
        unavailable=_object("status", "reason"),
    ),
    Operation("get", "/metrics", "Prometheus metrics", content=(TEXT,), tag="server"),
    Operation("get", "/dashboard/snapshot", "The scheduler's live view", answer={"type": "object"}, tag="server"),
    Operation("get", "/openapi.json", "This document", answer=_object("openapi", "paths"), tag="server"),
    Operation("get", "/", "The chat playground", content=(HTML,), tag="web"),
    Operation("get", "/dashboard", "The scheduler, live", content=(HTML,), tag="web"),
    Operation("get", "/ui/{name}", "The web pages' scripts, styles and icon", content=("*/*",), tag="web"),
)


def openapi_document(app: web.Application, facts: ServerFacts, version: str) -> dict[str, Any]:
    """The document of `app`'s routes that this server answers (`facts.runner`), its request schemas
    narrowed to what it accepts (`openapi_rules`)."""
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    operations = [op for op in OPERATIONS if (op.method, op.path) in routes and facts.runner in op.runners]
    bodies = sorted({op.body for op in operations if op.body is not None}, key=lambda t: t.__name__)
    refs, components = msgspec.json.schema_components(
        bodies, schema_hook=_any_json, ref_template="#/components/schemas/{name}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {"summary": op.summary, "tags": [op.tag], "responses": _responses(op)}
        if op.body is not None:
            entry["requestBody"] = {"required": True, "content": {JSON: {"schema": refs[bodies.index(op.body)]}}}
        parameters = [p.strip("{}") for p in op.path.split("/") if p.startswith("{")]
        if parameters:
            entry["parameters"] = [
                {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in parameters
            ]
        paths.setdefault(op.path, {})[op.method] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "batchserve", "version": version, "description": INTEGERS},
        "paths": paths,
        "components": {"schemas": {**narrowed(components, facts), "Error": ERROR}},
    }


def narrowed(components: dict[str, Schema], facts: ServerFacts) -> dict[str, Schema]:
    """msgspec's schemas of the structs (by name) with this server's rules written in."""
    out = copy.deepcopy(components)
    for name, rules in {**RULES, **MORE_RULES}.items():
        for rule in rules if name in out else ():
            rule(out[name], facts)
    return out


def server_facts(engine: EngineClient, config: ServerConfig, pooler: PoolerConfig | None) -> ServerFacts:
    """What the document says of this server (the served names are added when it is made)."""
    dimensions: Schema | None = None
    if pooler is not None and isinstance(pooler.matryoshka, tuple):
        dimensions = {"enum": list(pooler.matryoshka)}
    elif pooler is not None and pooler.matryoshka:
        dimensions = {"type": "integer", "minimum": 1, "maximum": pooler.hidden_size or INT32_MAX}
    return ServerFacts(
        runner="generate" if pooler is None else pooler.kind,
        max_context=engine.max_context,
        vocab_size=getattr(engine, "vocab_size", None),  # optional (`engine_client.py`)
        max_prompt_chars=engine.max_prompt_chars,
        max_in_flight=request_cap(config.max_running_requests, config.max_waiting),
        priority_scheduling=config.scheduling_policy == "priority",
        dimensions=dimensions,
    )


class ServedDocument:
    """The application's document: made on the first GET, once every route is added, and again when the
    served names change (a LoRA adapter loaded or unloaded at run time)."""

    def __init__(self, facts: ServerFacts, served: ServedModels) -> None:
        self.facts = facts
        self.served = served
        self.made: tuple[tuple[str, ...], bytes] | None = None

    def encoded(self, app: web.Application) -> bytes:
        names = (self.served.base, *self.served.adapters)
        if self.made is None or self.made[0] != names:
            document = openapi_document(app, replace(self.facts, served=names), VERSION)
            self.made = (names, msgspec.json.encode(document))
        return self.made[1]


def _responses(op: Operation) -> dict[str, Any]:
    content = {media: {"schema": op.answer if media == JSON and op.answer else {}} for media in op.content}
    error = {"content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
    responses = {"200": {"description": "OK", "content": content}, "default": {"description": "An error", **error}}
    if op.unavailable is not None:
        responses["503"] = {"description": "Not ready", "content": {JSON: {"schema": op.unavailable}}}
    return responses


DOCUMENT_KEY = web.AppKey("openapi_document", ServedDocument)


async def serve_document(request: web.Request) -> web.Response:
    """GET /openapi.json."""
    return web.Response(body=request.app[DOCUMENT_KEY].encoded(request.app), content_type=JSON)


# What JSON Schema cannot say of the free-form fields (schemas.INT_RANGE): said in the document's description
INTEGERS = (
    "Integers anywhere in a request body, inside free-form objects too (a JSON schema, chat template variables, "
    "a tool's parameters), lie in [-2**63, 2**64): the server's processes carry them as msgpack. Another is "
    "refused with a 400 naming the field."
)


def _any_json(kind: type) -> dict[str, Any]:
    """`object` fields (a JSON schema, chat template variables, ...) take any JSON value."""
    if kind is object:
        return {"description": "any JSON value (its integers within [-2**63, 2**64))"}
    raise TypeError(f"the OpenAPI document has no schema for {kind!r}: give the field a msgspec type")
