"""`/v1/score` and `/v1/rerank` end to end (issue 48): `batchserve serve` on a tiny BERT cross-encoder
(`--runner auto` serves `BertForSequenceClassification` with the pooling runner), called as vLLM's and
Jina's clients call them (plain JSON): scores equal to `CrossEncoder.predict` within 1e-4, vLLM's pairing
of text_1 and text_2, documents ranked best first with top_n and return_documents, the aliases `/rerank`
and `/v2/rerank`; the refusals (400 naming the field) for an empty query or documents, lists that do not
pair, embeddings asked of a cross-encoder, generation asked of a pooling server."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from e2e_server import http, start_server
from pooling_models import build_decoder_reranker, build_encoder, words

QUERY = words(4, 10)
DOCUMENTS = [words(9, 50), words(30, 80), words(2, 200), words(14, 11)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_encoder(tmp_path_factory.mktemp("cross-encoder") / "model", head="classification", num_labels=1)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server(
        model,
        tmp_path_factory.mktemp("e2e-rerank") / "serve.log",
        "--kv-capacity-tokens",
        "1024",
        "--max-running-requests",
        "4",
        "--prefill-budget",
        "64",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(model):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])


def test_score_pairs_as_vllm_does(server, model, reference):
    status, body = http(f"{server.url}/v1/score", {"model": str(model), "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference, atol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(len(QUERY.split()) + len(d.split()) + 3 for d in DOCUMENTS)
    status, body = http(f"{server.url}/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]})  # item by item
    assert status == 200 and np.allclose([d["score"] for d in body["data"]], reference[:2], atol=1e-4)


def test_rerank_ranks_best_first(server, model, reference):
    status, body = http(f"{server.url}/v1/rerank", {"model": str(model), "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    order = list(np.argsort(-reference))
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], reference[order], atol=1e-4)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    # the openai package has no rerank call: its client posts to any path (docs/api.md's example)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.post("/rerank", cast_to=object, body={"query": QUERY, "documents": DOCUMENTS, "top_n": 1})
    assert answer["results"][0]["index"] == order[0]
    for path in ("/rerank", "/v2/rerank"):
        status, top = http(
            f"{server.url}{path}", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
        )
        assert status == 200 and [r["index"] for r in top["results"]] == order[:2]
        assert all("document" not in r for r in top["results"])


def test_refusals_name_the_field(server, model):
    cases = [
        ("/v1/rerank", {"query": "", "documents": DOCUMENTS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": [DOCUMENTS[0], ""]}, "documents[1]"),
        ("/v1/rerank", {"query": QUERY, "documents": [words(80, 0)]}, "documents[0]"),
        ("/v1/score", {"text_1": [QUERY] * 3, "text_2": DOCUMENTS}, "text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": [DOCUMENTS[0], ""]}, "text_2[1]"),
        ("/v1/embeddings", {"input": QUERY}, "model"),
        ("/v1/completions", {"prompt": QUERY, "max_tokens": 2}, "model"),
    ]
    for path, body, param in cases:
        status, answer = http(f"{server.url}{path}", {"model": str(model), **body})
        assert status == 400 and answer["error"]["param"] == param, (path, body, answer)
    status, answer = http(
        f"{server.url}/v1/rerank", {"query": QUERY, "documents": [words(80, 0)], "truncate_prompt_tokens": 64}
    )
    assert status == 200 and answer["usage"]["prompt_tokens"] == 64  # the document cut to fit
    status, answer = http(
        f"{server.url}/v1/rerank", {"query": words(70, 0), "documents": [DOCUMENTS[0]], "truncate_prompt_tokens": 64}
    )  # the query alone is longer
    assert status == 400 and answer["error"]["param"] == "truncate_prompt_tokens", answer


def test_a_decoder_reranker_ranks_as_sentence_transformers(tmp_path):
    """Qwen3-Reranker's form served: `/v1/rerank` renders each pair through the chat template as a query and
    a document message, and scores it by the yes/no logits of its last token."""
    from sentence_transformers import CrossEncoder

    model = build_decoder_reranker(tmp_path / "reranker")
    documents = ["the lazy dog jumps over the fox", "b", "the quick brown fox jumps over the lazy dog " * 3]
    reference = CrossEncoder(str(model), device="cpu").predict([("the quick fox", d) for d in documents])
    server = start_server(
        model,
        tmp_path / "serve.log",
        "--kv-capacity-tokens",
        "1024",
        "--prefill-budget",
        "32",
        "--max-running-requests",
        "4",
        "--max-context",
        "512",
    )
    try:
        status, body = http(f"{server.url}/v1/rerank", {"query": "the quick fox", "documents": documents})
        refused = http(f"{server.url}/v1/rerank", {"query": "the quick fox", "documents": ["a " * 600]})
        cut = http(
            f"{server.url}/v1/rerank",
            {"query": "the quick fox", "documents": ["a " * 600], "truncate_prompt_tokens": 250},
        )
        too_short = http(
            f"{server.url}/v1/rerank", {"query": "the quick fox", "documents": ["a b c"], "truncate_prompt_tokens": 5}
        )
    finally:
        server.stop()
    assert status == 200, body
    order = list(np.argsort(-reference))
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], reference[order], atol=1e-4)
    assert refused[0] == 400 and refused[1]["error"]["param"] == "documents[0]"
    # the document's end is cut until the rendered pair fits (the judging prompt and the query stay)
    assert cut[0] == 200 and 240 <= cut[1]["usage"]["prompt_tokens"] <= 250, cut
    assert too_short[0] == 400 and too_short[1]["error"]["param"] == "truncate_prompt_tokens"
