"""Multi-LoRA through the API (issue 47, third part), with the `openai` package as users call it: a request
names an adapter in `model` on every endpoint (completions, chat, responses, tokenize) and the answer names
it back; `/v1/models` lists the adapters with `parent` the base model; an unknown name is 404
model_not_found; an adapter named as the base model is refused at start. End to end, `batchserve serve
--enable-lora --lora-modules a=... b=...`: greedy text of each adapter equal to PEFT's, the base beside it."""

from __future__ import annotations

import asyncio

import openai
import pytest
from aiohttp.test_utils import TestServer
from api_fake_engine import FakeEngine
from test_lora_engine import PROMPTS, setup  # noqa: F401 (the adapters and PEFT's tokens, a module fixture)
from test_lora_worker import NEW_TOKENS

from batchserve.procs.api.app import create_app
from batchserve.shared.config import ServerConfig

CONFIG = ServerConfig(
    enable_lora=True, lora_modules=["sql=/adapters/sql", "chat=/adapters/chat"], responses_store="memory"
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_model_names_an_adapter_on_every_endpoint():
    engine = FakeEngine(["ok"])

    async def go():
        async with (
            TestServer(create_app(engine, CONFIG)) as server,
            openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as client,
        ):
            models = [(m.id, getattr(m, "parent", None)) for m in (await client.models.list()).data]
            completion = await client.completions.create(model="sql", prompt="hi", max_tokens=2)
            chat = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
            base = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}]
            )
            response = await client.responses.create(model="chat", input="hi")
            with pytest.raises(openai.NotFoundError, match="serves `fake-model`, `sql`, `chat`"):
                await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
            async with __import__("aiohttp").ClientSession() as http:
                async with http.post(server.make_url("/tokenize"), json={"model": "sql", "prompt": "hi"}) as tok:
                    tokenized = tok.status
                async with http.get(server.make_url("/metrics")) as page:
                    metrics = await page.text()
            return models, (completion.model, chat.model, base.model, response.model), tokenized, metrics

    models, names, tokenized, metrics = run(go())
    assert 'batchserve_lora_requests_total{adapter="chat"} 2.0' in metrics
    assert 'batchserve_lora_requests_total{adapter="sql"} 1.0' in metrics
    assert 'batchserve_lora_generation_tokens_total{adapter="sql"}' in metrics
    assert models == [("fake-model", None), ("sql", "fake-model"), ("chat", "fake-model")]
    assert names == ("sql", "chat", "fake-model", "chat") and tokenized == 200
    assert [r.params.adapter for r in engine.requests] == [1, 2, 0, 2]


def test_an_adapter_named_as_the_base_model_is_refused():
    with pytest.raises(ValueError, match="the adapter name 'fake-model' is the served model's name"):
        create_app(FakeEngine(), ServerConfig(enable_lora=True, lora_modules=["fake-model=/x"]))


def test_serve_with_two_adapters_answers_as_peft(setup, tmp_path):  # noqa: F811
    from e2e_server import start_server

    base, folders, expected = setup
    modules = [f"{name}={folder}" for name, folder in folders.items()]
    server = start_server(
        base, tmp_path / "serve.log", "--kv-capacity-tokens", "1024", "--enable-lora", "--lora-modules", *modules
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        got = {
            name: [
                client.completions.create(
                    model=name if name != "base" else str(base),
                    prompt=p,
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in PROMPTS[:2]
            ]
            for name in ("a", "base", "b")
        }
    finally:
        assert server.stop() == 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    for name, completions in got.items():
        assert [c.choices[0].text.strip() for c in completions] == [
            tokenizer.decode(t).strip() for t in expected[name][:2]
        ], name
