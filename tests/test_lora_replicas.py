"""Runtime LoRA updates with data-parallel replicas (issue 47): `batchserve serve --data-parallel-size 2 --router
smg --enable-lora --enable-lora-runtime-updates` with API keys. What the gateway does: smg 1.13 has no such
route and answers 404 `unknown_url` itself; and it knows a replica by its served model alone, so it answers
a request naming any adapter (of `--lora-modules` or loaded later) with 404 `No worker available` (its
`--model-alias` would route it, but rewrites `model` to the base model's name: the replica would answer with
the base weights, measured so, and is not used). A load sent to either replica is passed on to the other
(with the replicas' internal key), so both serve the adapter alike; an unload sent to either leaves neither
serving it. Skipped where smg's wheel is not installed (the router extra)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from e2e_server import ReplicatedServer
from test_lora_worker import ADAPTERS, make_adapter

pytest.importorskip("smg", reason="smg is not installed: `pip install -e '.[router]'` installs the gateway")

KEY = "k1"


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def models(url: str) -> list[str]:
    return [m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).models.list().data]


def answer(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt="the fox", max_tokens=8, temperature=0).choices[0].text


def test_a_runtime_load_and_unload_through_the_gateway_reach_every_replica(tiny_model_dir, tmp_path):
    base = tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)
    folder = make_adapter(base, tmp_path / "adapter", 0, **ADAPTERS["a"])
    server = ReplicatedServer(base, tmp_path / "serve.log", "--data-parallel-size", "2", "--router", "smg",
                              "--kv-capacity-tokens", "2048", "--api-key", KEY, "--enable-lora",
                              "--enable-lora-runtime-updates", "--lora-modules", f"static={folder}")
    server.start()
    try:
        # smg 1.13 knows no such route: the gateway answers 404 itself, and the update goes to a replica
        at_gateway = post(f"{server.url}/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(folder)})
        loaded = post(f"{server.replica_urls[1]}/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(folder)})
        listed = [models(url) for url in server.replica_urls]
        texts = [answer(url, "tuned") for url in server.replica_urls]
        static = [answer(url, "static") for url in server.replica_urls]
        for name in ("static", "tuned"):  # smg knows a replica by its served model alone
            with pytest.raises(openai.NotFoundError, match=f"No worker available for model '{name}'"):
                answer(server.url, name)
        base_text = answer(server.replica_urls[0], str(base))
        unloaded = post(f"{server.replica_urls[0]}/v1/unload_lora_adapter", {"lora_name": "tuned"})
        after = [models(url) for url in server.replica_urls]
        gone = []
        for url in server.replica_urls:
            with pytest.raises(openai.NotFoundError) as refusal:
                answer(url, "tuned")
            gone.append(refusal.value.status_code)
    finally:
        assert server.stop() == 0, server.log_tail()
    assert at_gateway[0] == 404 and "unknown_url" in at_gateway[1], at_gateway
    assert loaded == (200, "Success: LoRA adapter 'tuned' added successfully."), loaded
    assert all("tuned" in names for names in listed), listed
    assert len(set(texts)) == 1 and texts[0] != base_text  # every replica runs the same adapter's weights
    assert static == texts  # the same folder, loaded at start
    assert unloaded == (200, "Success: LoRA adapter 'tuned' removed successfully."), unloaded
    assert all("tuned" not in names for names in after) and gone == [404, 404]
