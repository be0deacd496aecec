"""The pooling runner with data-parallel replicas behind the smg gateway (issue 48): `batchserve serve
--data-parallel-size 2 --router smg` on a tiny embedder, with API keys. What smg 1.13 does, measured:
it routes `/v1/embeddings` to the replicas (the answer equals a replica's own); it does not route
`/v1/score` (404 `unknown_url`, its own); and its `/v1/rerank` replaces the client's `model` with
"unknown" before forwarding (a replica answers 404 naming it; smg's own docs list the bug), so score and
rerank are called on the replicas' ports. Skipped where smg's wheel is not installed (the router extra)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from e2e_server import ReplicatedServer, http
from pooling_models import build_st_embedder, words

pytest.importorskip("smg", reason="smg is not installed: `pip install -e '.[router]'` installs the gateway")

KEY = "k1"


def test_embeddings_through_the_gateway_and_scores_at_the_replicas(tmp_path):
    model = build_st_embedder(tmp_path / "model", pooling="mean")
    server = ReplicatedServer(
        model,
        tmp_path / "serve.log",
        "--data-parallel-size",
        "2",
        "--router",
        "smg",
        "--kv-capacity-tokens",
        "1024",
        "--max-running-requests",
        "4",
        "--api-key",
        KEY,
    )
    server.start()
    try:

        def embed(url: str):
            return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).embeddings.create(
                model=str(model), input=[words(5, 0), words(9, 30)]
            )

        through = [embed(server.url) for _ in range(4)]  # round the replicas
        direct = [embed(url) for url in server.replica_urls]
        body = {"model": str(model), "query": words(3, 0), "documents": [words(5, 0), words(4, 90)]}
        at_replicas = [http_with_key(f"{url}/v1/rerank", body) for url in server.replica_urls]
        rerank_at_gateway = http_with_key(f"{server.url}/v1/rerank", body)
        score_at_gateway = http_with_key(f"{server.url}/v1/score", {"text_1": "w5", "text_2": "w6"})
        unauthorised = http(f"{server.replica_urls[0]}/v1/rerank", body)
    finally:
        server.stop()
    vectors = [np.array([d.embedding for d in answer.data]) for answer in (*through, *direct)]
    assert all(np.allclose(v, vectors[-1], atol=1e-5) for v in vectors)
    assert [status for status, _ in at_replicas] == [200, 200]
    assert at_replicas[0][1]["results"] == at_replicas[1][1]["results"]
    status, answer = rerank_at_gateway
    assert status == 404 and "The model `unknown` does not exist" in answer["error"]["message"]
    assert score_at_gateway[0] == 404 and score_at_gateway[1]["error"]["code"] == "unknown_url"
    assert unauthorised[0] == 401


def http_with_key(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
