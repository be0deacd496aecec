"""`/v1/embeddings` end to end (issue 48): `batchserve serve` (five real processes) on a tiny
sentence-transformers embedder, which `--runner auto` serves with the pooling runner because its folder
has modules.json, called through the `openai` package as users call it: float and base64 vectors equal
to `SentenceTransformer.encode` within 1e-4, token-id inputs, usage, Matryoshka `dimensions`, a small
prefill budget chunking the inputs; the refusals (400 naming the field) for an empty input, an input
over the context, `dimensions` the model was not trained for, generation on a pooling server; /metrics
and the KV pool empty after the requests (no prefix cache keeps them)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from e2e_server import http, metric, start_server, wait_until
from pooling_models import build_st_embedder, st_vectors, words

TEXTS = [words(5, 0), words(30, 40), words(90, 100), words(2, 250)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_st_embedder(
        tmp_path_factory.mktemp("embedder") / "model", pooling="mean", matryoshka_dimensions=[16, 32]
    )


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server(
        model,
        tmp_path_factory.mktemp("e2e-emb") / "serve.log",
        "--kv-capacity-tokens",
        "1024",
        "--max-running-requests",
        "4",
        "--prefill-budget",
        "32",
        "--max-context",
        "128",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_vectors_through_the_openai_package(client, model):
    reference = st_vectors(model, TEXTS)
    floats = client.embeddings.create(model=str(model), input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2, 3]
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), reference, atol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 5 + 30 + 90 + 2
    assert floats.model == str(model)
    # the package asks for base64 by default and decodes it (float32 little-endian) itself
    default = client.embeddings.create(model=str(model), input=TEXTS[1])
    np.testing.assert_allclose(default.data[0].embedding, reference[1], atol=1e-4)
    ids = [int(w[1:]) for w in TEXTS[2].split()]
    by_ids = client.embeddings.create(model=str(model), input=[ids, ids[:7]])
    np.testing.assert_allclose(by_ids.data[0].embedding, reference[2], atol=1e-4)
    cut = client.embeddings.create(model=str(model), input=TEXTS[0], dimensions=16)
    expected = reference[0][:16] / np.linalg.norm(reference[0][:16])
    np.testing.assert_allclose(cut.data[0].embedding, expected, atol=1e-4)
    assert abs(np.linalg.norm(cut.data[0].embedding) - 1) < 1e-5


def test_refusals_name_the_field(client, server, model):
    cases = [
        ({"input": ""}, "input"),
        ({"input": [TEXTS[0], ""]}, "input[1]"),
        ({"input": []}, "input"),
        ({"input": words(200, 0)}, "input"),
        ({"input": [TEXTS[0], words(200, 0)]}, "input[1]"),
        ({"input": TEXTS[0], "dimensions": 24}, "dimensions"),
        ({"input": TEXTS[0], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ]
    for body, param in cases:
        status, answer = http(f"{server.url}/v1/embeddings", {"model": str(model), **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = http(
        f"{server.url}/v1/embeddings", {"model": str(model), "input": words(200, 0), "truncate_prompt_tokens": 128}
    )
    assert status == 200 and answer["usage"]["prompt_tokens"] == 128
    with pytest.raises(openai.BadRequestError, match="it answers /v1/embeddings, not /v1/completions"):
        client.completions.create(model=str(model), prompt="w5", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not /v1/chat"):
        client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": "w5"}])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="w5")


def test_metrics_and_kv_after_the_requests(client, server, model):
    def prompt_tokens() -> float:
        return metric(server.url, "batchserve_prompt_tokens_total")

    before = prompt_tokens()
    client.embeddings.create(model=str(model), input=TEXTS)
    assert prompt_tokens() - before == 5 + 30 + 90 + 2
    assert metric(server.url, 'batchserve_request_success_total{finish_reason="stop"}') >= 1
    # every vector's KV is freed the step it is pooled, none kept for a prefix cache
    assert wait_until(lambda: metric(server.url, "batchserve_kv_cache_used_tokens") == 0, timeout=10)


def test_an_embedding_model_scores_pairs_by_cosine(server, model):
    """vLLM's /score and /rerank on an embedding model: the cosine of the two texts' vectors."""
    reference = st_vectors(model, TEXTS[:3])
    cosines = reference[1:] @ reference[0]
    status, body = http(f"{server.url}/v1/score", {"model": str(model), "text_1": TEXTS[0], "text_2": TEXTS[1:3]})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], cosines, atol=1e-4)
    status, body = http(f"{server.url}/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:3]})
    assert status == 200 and [r["index"] for r in body["results"]] == list(np.argsort(-cosines))
