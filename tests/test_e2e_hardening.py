"""Issue 66's defects, each through the real server (`batchserve serve` on a tiny random model): huge
integers, a schema with no finite instance, a client idle between two requests on one keep-alive
connection, a malformed request line, a float where an integer belongs. None may be a 5xx, and none may
leave an ERROR line or a traceback in the server's log."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
from e2e_server import http, start_server

HUGE = 2**64
CHAT = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4}
RECURSIVE = {
    "$defs": {"n": {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}}, "required": ["child"]}},
    "$ref": "#/$defs/n",
}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server(model, tmp_path_factory.mktemp("hardening") / "serve.log", "--kv-capacity-tokens", "2048")
    yield srv
    srv.stop()


def assert_quiet_log(server) -> None:
    log = server.log()
    assert "Traceback" not in log and not re.search(r'"level": "ERROR"|\bERROR\b', log), log[-3000:]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "w5", "max_tokens": HUGE}, "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "min_tokens": HUGE}, "min_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": HUGE}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": HUGE}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "min_tokens": HUGE}, "min_tokens"),
        ("/v1/responses", {"input": "w5", "max_output_tokens": HUGE}, "max_output_tokens"),
        ("/v1/responses", {"input": "w5", "min_tokens": HUGE}, "min_tokens"),
    ],
)
def test_a_huge_integer_is_a_400_naming_the_field_and_its_range(server, path, body, field):
    status, answer = http(server.url + path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == field and "<= 2147483647" in answer["error"]["message"], answer


def test_a_float_for_top_k_is_named_for_what_it_is(server):
    status, answer = http(server.url + "/v1/completions", {"prompt": "w5", "top_k": 1e30})
    assert status == 400 and answer["error"]["param"] == "top_k", answer
    assert "Expected `int | null`, got `float`" in answer["error"]["message"], answer


def test_a_schema_with_no_finite_instance_is_refused_up_front(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": RECURSIVE}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=str(model), response_format=schema, stream=stream, **CHAT)
        assert "no finite instance" in str(caught.value) and caught.value.body["param"] == "response_format"
    status, answer = http(server.url + "/v1/completions", {"prompt": "w5", "guided_json": RECURSIVE})
    assert status == 400 and answer["error"]["param"] == "guided_json", answer


def test_a_client_idle_for_12_s_posts_again_on_the_same_connection(server):
    """aiohttp's client keeps a pooled connection 15 s; the server keeps it 75 s (and says so), so the
    second POST reuses the connection instead of meeting one the server closed."""

    async def post(session: aiohttp.ClientSession) -> tuple[int, str | None, object]:
        async with session.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2}) as r:
            await r.read()
            return r.status, r.headers.get("Keep-Alive"), r.connection and r.connection.transport

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            first = await post(session)
            await asyncio.sleep(12)
            return first, await post(session)

    first, second = asyncio.run(go())
    assert first[:2] == second[:2] == (200, "timeout=75"), (first, second)
    assert first[2] is second[2]  # the same connection


def test_what_the_fuzzer_found_is_a_4xx(server):
    """Schemathesis's finds (tests/test_openapi_fuzz.py): a repetition penalty past float32 killed the
    worker; a control character in a stored response's id broke the X-Request-Id header (a 500)."""
    status, answer = http(server.url + "/v1/completions", {"prompt": "w5", "repetition_penalty": 4.3e307})
    assert status == 400 and answer["error"]["param"] == "repetition_penalty", answer
    for method in ("GET", "DELETE"):
        request = urllib.request.Request(server.url + "/v1/responses/%1F", method=method)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 404
    assert http(server.url + "/health")[0] == 200


def test_a_20_kb_path_is_a_400_logged_without_a_traceback(server):
    status, _ = http(server.url + "/v1/" + "a" * 20_000)
    assert status == 400
    status, _ = http(server.url + "/health")
    assert status == 200


def test_the_log_holds_no_error(server):
    """Run last in the module: after every request above."""
    assert_quiet_log(server)
