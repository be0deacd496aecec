"""The OpenAPI document (`procs.api.openapi`): every route the application registers is in it, and its
request schemas are the structs' own (ranges included), so it cannot drift from validation."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.procs.api.openapi import OPERATIONS
from batchserve.shared.config import ServerConfig


def fetch(config: ServerConfig) -> tuple[dict, set[tuple[str, str]]]:
    async def go():
        app = create_app(FakeEngine(), config)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/openapi.json")
            assert resp.status == 200 and resp.content_type == "application/json"
            routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
            return await resp.json(), routes

    return asyncio.run(go())


def test_every_route_is_documented_and_only_those():
    for config in (ServerConfig(), ServerConfig(webui=False, enable_lora=True, enable_lora_runtime_updates=True)):
        document, routes = fetch(config)
        documented = {(method, path) for path, entry in document["paths"].items() for method in entry}
        assert documented == routes
        assert routes <= {(op.method, op.path) for op in OPERATIONS}


def test_request_schemas_carry_the_structs_ranges_and_the_served_name():
    document, _ = fetch(ServerConfig())
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    max_tokens = chat["max_tokens"]["anyOf"][0]
    assert (max_tokens["minimum"], max_tokens["maximum"]) == (0, 2**31 - 1)
    assert chat["model"] == {"anyOf": [{"enum": ["fake-model"]}, {"type": "null"}]}
    assert chat["temperature"]["anyOf"][0]["maximum"] == 2.0
    completions = document["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


def test_the_document_is_open_where_api_keys_guard_the_api():
    """As /health: a client reads the document before it has a key; /v1/ stays guarded."""

    async def go():
        async with TestClient(TestServer(create_app(FakeEngine(), ServerConfig(api_key="secret")))) as client:
            return (await client.get("/openapi.json")).status, (await client.get("/v1/models")).status

    assert asyncio.run(go()) == (200, 401)
