"""The pooling endpoints' HTTP side (issue 48), on a fake engine whose vectors are known: API keys guard
`/v1/embeddings` and the `/score`, `/rerank` and `/v2/rerank` aliases; each input is one engine request
with `PoolingParams`, `max_tokens` 0, the body's priority and truncation; the runner decides which
endpoints answer; base64 is float32 little-endian; a cross-encoder's logits go through its activation."""

from __future__ import annotations

import asyncio
import base64

import aiohttp
import numpy as np
from aiohttp.test_utils import TestServer
from api_fake_engine import FakeEngine

from batchserve.procs.api.app import create_app
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import TextDelta, Usage
from batchserve.shared.pooling import PoolerConfig

EMBEDDER = PoolerConfig(pooling="mean", normalize=False, matryoshka=True, hidden_size=3)
CROSS_ENCODER = PoolerConfig(pooling="cls", normalize=False, kind="classify", activation="sigmoid")


class PoolingEngine(FakeEngine):
    """Answers a pooling request with the vector [words, words of its pair, 1] (its words the prompt tokens)."""

    async def _run(self, request):
        self.requests.append(request)
        words = len((request.prompt or "").split()) + len(request.prompt_token_ids or [])
        pair = len((request.prompt_pair or "").split())
        vector = np.asarray([words, pair, 1.0], dtype="<f4").tobytes()
        yield TextDelta(
            rid=request.rid,
            text="",
            token_ids=[],
            finish_reason="stop",
            pooled=vector,
            usage=Usage(prompt_tokens=words + pair, completion_tokens=0, total_tokens=words + pair),
        )


def run(pooler: PoolerConfig | None, calls, config: ServerConfig | None = None):
    config = config or ServerConfig()
    engine = PoolingEngine()

    async def go():
        async with TestServer(create_app(engine, config, pooler=pooler)) as server, aiohttp.ClientSession() as http:

            async def post(path: str, body: dict, **headers) -> tuple[int, dict]:
                async with http.post(server.make_url(path), json=body, headers=headers) as response:
                    return response.status, await response.json()

            return await calls(post)

    return engine, asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_embeddings_requests_and_answers():
    async def calls(post):
        return (
            await post("/v1/embeddings", {"input": ["a b c", "d"], "priority": 0, "truncate_prompt_tokens": 5}),
            await post("/v1/embeddings", {"input": [7, 8], "encoding_format": "base64", "dimensions": 2}),
        )

    engine, ((status, body), (status64, body64)) = run(EMBEDDER, calls)
    assert status == 200 and [d["embedding"] for d in body["data"]] == [[3, 0, 1], [1, 0, 1]]
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    first = engine.requests[0]
    assert first.params.stop.max_tokens == 0 and first.params.pooling.truncate_prompt_tokens == 5
    assert [r.rid.rsplit("-", 1)[1] for r in engine.requests[:2]] == ["0", "1"]  # one engine request per input
    assert status64 == 200
    vector = np.frombuffer(base64.b64decode(body64["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == [2.0, 0.0]  # the cut to 2 dimensions (not normalised: the model does not)


def test_cross_encoder_scores_and_ranks():
    async def calls(post):
        return (
            await post("/v1/score", {"text_1": "q", "text_2": ["a b", "a b c d", "a"]}),
            await post("/v2/rerank", {"query": "q", "documents": ["a b", "a b c d", "a"], "top_n": 2}),
            await post("/v1/embeddings", {"input": "a"}),
        )

    engine, ((status, score), (_, rerank), (refused, error)) = run(CROSS_ENCODER, calls)
    assert status == 200
    # the fake's logit is the first text's words (1): every pair scores sigmoid(1); the pair went as prompt_pair
    assert [round(d["score"], 6) for d in score["data"]] == [round(1 / (1 + np.exp(-1.0)), 6)] * 3
    assert [r.prompt_pair for r in engine.requests[:3]] == ["a b", "a b c d", "a"]
    assert len(rerank["results"]) == 2 and rerank["results"][0]["document"] == {"text": "a b"}
    assert refused == 400 and error["error"]["param"] == "model" and "cross-encoder" in error["error"]["message"]


def test_the_runner_decides_the_endpoints():
    async def calls(post):
        return (await post("/v1/embeddings", {"input": "a"}), await post("/rerank", {"query": "q", "documents": ["a"]}))

    _, ((status, body), (rerank_status, rerank)) = run(None, calls)  # a generating server
    assert status == 400 and body["error"]["param"] == "model" and "--runner generate" in body["error"]["message"]
    assert rerank_status == 400 and "does not answer /v1/rerank" in rerank["error"]["message"]

    async def generate(post):
        return await post("/v1/completions", {"prompt": "a", "max_tokens": 2})

    _, (status, body) = run(EMBEDDER, generate)
    assert status == 400 and "it answers /v1/embeddings, not /v1/completions" in body["error"]["message"]


def test_api_keys_guard_the_pooling_paths():
    async def calls(post):
        without = [
            await post(path, body)
            for path, body in (
                ("/v1/embeddings", {"input": "a"}),
                ("/score", {"text_1": "a", "text_2": "b"}),
                ("/rerank", {"query": "a", "documents": ["b"]}),
                ("/v2/rerank", {"query": "a", "documents": ["b"]}),
            )
        ]
        with_key = await post("/v1/embeddings", {"input": "a"}, Authorization="Bearer sk-1")
        return without, with_key

    _, (without, (status, _)) = run(EMBEDDER, calls, ServerConfig(api_key=["sk-1"]))
    assert [s for s, _ in without] == [401] * 4
    assert status == 200
