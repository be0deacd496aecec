"""The api's OpenAPI 3.1 document, served at `/openapi.json`.

Request bodies are the JSON Schemas of the same msgspec structs `decode_body` decodes with, ranges
included (`field_types`), so the document cannot drift from what is validated; a served model name is
the `model` field's enum. Every route the application registers has an entry in `OPERATIONS` (a test
checks that), and the document lists those of this server: the pooling routes only where a pooling
model is served, the web pages only with --webui. Answers are described as far as clients rely on them
(the keys every answer carries); every error is an OpenAI error body. CI fuzzes the document's
operations against a running server with Schemathesis (tests/test_openapi_fuzz.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import msgspec
from aiohttp import web

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

JSON, SSE, TEXT, HTML = "application/json", "text/event-stream", "text/plain", "text/html"
VERSION = version("batchserve")
OPENAPI_KEY = web.AppKey("openapi", bytes)
SERVED_KEY = web.AppKey("served_models", ServedModels)


def _object(*required: str, **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": properties}


ERROR = _object("error", error=_object("message", "type", message={"type": "string"}, type={"type": "string"}))
_CHOICES = {"type": "array", "items": {"type": "object"}}
COMPLETION = _object("id", "object", "created", "model", "choices", choices=_CHOICES)
RESPONSE = _object("id", "object", "status", object={"const": "response"})
LIST = _object("object", "data", object={"const": "list"}, data={"type": "array"})


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


GENERATING = (JSON, SSE)  # `stream`: SSE, else JSON
OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "post", "/v1/completions", "A completion (streamed with `stream`)", CompletionRequest, COMPLETION, GENERATING
    ),
    Operation("post", "/v1/chat/completions", "A chat completion", ChatCompletionRequest, COMPLETION, GENERATING),
    Operation("post", "/v1/responses", "A response (OpenAI's Responses API)", ResponsesRequest, RESPONSE, GENERATING),
    Operation("get", "/v1/responses/{response_id}", "A stored response", answer=RESPONSE),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response", answer=_object("id", "deleted")),
    Operation("get", "/v1/models", "The served models", answer=LIST),
    Operation("post", "/v1/embeddings", "Embeddings (a pooling model)", EmbeddingsBody, LIST),
    Operation("post", "/v1/score", "Scores of text pairs", ScoreBody, LIST),
    Operation("post", "/score", "Scores of text pairs (vLLM's path)", ScoreBody, LIST),
    Operation("post", "/v1/rerank", "Documents reranked for a query", RerankBody, _object("results")),
    Operation("post", "/rerank", "Reranking (vLLM's path)", RerankBody, _object("results")),
    Operation("post", "/v2/rerank", "Reranking (Cohere's v2 path)", RerankBody, _object("results")),
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


def openapi_document(app: web.Application, served: list[str], version: str) -> dict[str, Any]:
    """The document of `app`'s routes; `served`: the model names `model` may take (or null)."""
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    operations = [op for op in OPERATIONS if (op.method, op.path) in routes]
    bodies = sorted({op.body for op in operations if op.body is not None}, key=lambda t: t.__name__)
    refs, components = msgspec.json.schema_components(
        bodies, schema_hook=_any_json, ref_template="#/components/schemas/{name}"
    )
    for struct in bodies:
        _name_the_models(components[struct.__name__], served)
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
        "info": {"title": "batchserve", "version": version},
        "paths": paths,
        "components": {"schemas": {**components, "Error": ERROR}},
    }


def _responses(op: Operation) -> dict[str, Any]:
    content = {media: {"schema": op.answer if media == JSON and op.answer else {}} for media in op.content}
    error = {"content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
    responses = {"200": {"description": "OK", "content": content}, "default": {"description": "An error", **error}}
    if op.unavailable is not None:
        responses["503"] = {"description": "Not ready", "content": {JSON: {"schema": op.unavailable}}}
    return responses


async def serve_document(request: web.Request) -> web.Response:
    """GET /openapi.json (made once, from the application's routes once they are all added)."""
    app = request.app
    if OPENAPI_KEY not in app:
        served = app[SERVED_KEY]
        app[OPENAPI_KEY] = msgspec.json.encode(openapi_document(app, [served.base, *served.adapters], VERSION))
    return web.Response(body=app[OPENAPI_KEY], content_type=JSON)


def _any_json(kind: type) -> dict[str, Any]:
    """`object` fields (a JSON schema, chat template variables, ...) take any JSON value."""
    if kind is object:
        return {"description": "any JSON value"}
    raise TypeError(f"the OpenAPI document has no schema for {kind!r}: give the field a msgspec type")


def _name_the_models(schema: dict[str, Any], served: list[str]) -> None:
    """`model`: one of the served names, or null (the server's only model)."""
    model = schema.get("properties", {}).get("model")
    if model is not None:
        schema["properties"]["model"] = {"anyOf": [{"enum": served}, {"type": "null"}]}
