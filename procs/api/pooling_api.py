"""The pooling runner's endpoints: `POST /v1/embeddings` (OpenAI's shape), `/v1/score` and `/v1/rerank`
(vLLM's, the latter Jina's and Cohere's shape; also at `/score`, `/rerank` and `/v2/rerank`).

Each input is one engine request (`rid-i` with `PoolingParams`), run together like a completion's
prompts, whose last `TextDelta` carries its vector (`pooled`). What the vector means is the model's
(`shared.pooling.PoolerConfig.kind`):
- an embedding model answers `/v1/embeddings`: `input` (a text, texts, token ids or lists of them),
  `encoding_format` float | base64 (float32 little-endian, as OpenAI's clients decode it), `dimensions`
  (a Matryoshka cut where the model was trained for it), `user` (accepted, unused), vLLM's
  `truncate_prompt_tokens` (only an input's last k tokens) and `priority`. It scores a pair by the cosine
  of the two texts' vectors (each text run once);
- a cross-encoder answers `/v1/score` and `/v1/rerank`: each pair is one input, its two texts joined
  by the model's tokenizer, its score the model's logit after its activation.
`/v1/score` pairs `text_1` with `text_2` (one text with each of a list, or two lists of one length);
`/v1/rerank` pairs the `query` with each of `documents` and answers them by score, best first (`top_n`
of them, with their text unless `return_documents` is false). A refused input is named by its field
(`input[i]`, `text_2[i]`, `documents[i]`); a generation endpoint on a pooling server, or the reverse,
is 400 naming the runner.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Literal, NamedTuple

import msgspec
import numpy as np
from aiohttp import web
from msgspec import Meta

from batchserve.procs.api.errors import refusal_response, request_error
from batchserve.procs.api.fanout import EngineFailure, Fanout, choice_requests
from batchserve.procs.api.field_types import INT32_MAX, Priority, TokenId, TruncateTokens
from batchserve.procs.api.prompt_fields import prompt_inputs
from batchserve.procs.api.schemas import decode_body
from batchserve.procs.api.tracking import RequestTracker
from batchserve.procs.api.validation import check_model
from batchserve.shared.checks import check_priority
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import (
    ChatMessage,
    GenerateRequest,
    PoolingParams,
    RequestParams,
    RequestRejected,
    StopParams,
    Usage,
)
from batchserve.shared.pooling import PoolerConfig, finish_vector


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    input: str | list[str | TokenId | list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None  # vLLM's: -1 = the context
    priority: Priority | None = None


class ScoreBody(msgspec.Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    priority: Priority | None = None


class RerankBody(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None  # none or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: TruncateTokens | None = None
    priority: Priority | None = None


class _Inputs(msgspec.Struct):
    """A body's engine inputs: (text, token ids, the pair's second text) each, and the field naming each."""

    inputs: list[tuple[str | None, list[int] | None, str | None]]
    params: list[str]


Answer = Callable[[list[bytes], Usage], dict]
Body = EmbeddingsBody | ScoreBody | RerankBody


def add_pooling_routes(app: web.Application, handlers) -> None:
    """Register the pooling endpoints on the api's application (`handlers`: its `ApiHandlers`)."""
    routes = _PoolingRoutes(handlers)
    app.router.add_post("/v1/embeddings", routes.embeddings)
    for path in ("/v1/score", "/score"):
        app.router.add_post(path, routes.score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, routes.rerank)


class _PoolingRoutes:
    def __init__(self, handlers) -> None:
        self.handlers = handlers

    async def embeddings(self, request: web.Request) -> web.Response:
        def prepare(raw: bytes, pooler: PoolerConfig) -> tuple[Body, _Inputs, Answer]:
            if pooler.kind != "embed":
                raise Refusal(
                    "this model is a cross-encoder: it scores pairs of texts (/v1/score, /v1/rerank), it "
                    "computes no embeddings",
                    "model",
                )
            body = decode_body(raw, EmbeddingsBody)
            pooler.check_dimensions(body.dimensions)
            found = prompt_inputs(body.input, "input")
            inputs = _Inputs([(text, ids, None) for _, text, ids in found], [param for param, _, _ in found])

            def answer(pooled: list[bytes], usage: Usage) -> dict:
                vectors = [finish_vector(p, body.dimensions, pooler.normalize) for p in pooled]
                return {
                    "object": "list",
                    "model": self._model_name(),
                    "data": [
                        {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                        for i, v in enumerate(vectors)
                    ],
                    "usage": _usage(usage),
                }

            return body, inputs, answer

        return await self._run(request, "embeddings", "embd-", prepare)

    async def score(self, request: web.Request) -> web.Response:
        def prepare(raw: bytes, pooler: PoolerConfig) -> tuple[Body, _Inputs, Answer]:
            body = decode_body(raw, ScoreBody)
            pairs = _pairs(body.text_1, body.text_2)
            inputs, scores = _scored(pairs, pooler)

            def answer(pooled: list[bytes], usage: Usage) -> dict:
                return {
                    "id": f"score-{uuid.uuid4().hex}",
                    "object": "list",
                    "created": int(time.time()),
                    "model": self._model_name(),
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores(pooled))],
                    "usage": _usage(usage),
                }

            return body, inputs, answer

        return await self._run(request, "score", "score-", prepare)

    async def rerank(self, request: web.Request) -> web.Response:
        def prepare(raw: bytes, pooler: PoolerConfig) -> tuple[Body, _Inputs, Answer]:
            body = decode_body(raw, RerankBody)
            if not body.query:
                raise Refusal("query must not be empty", "query")
            if not body.documents:
                raise Refusal("documents must not be empty", "documents")
            empty = next((i for i, document in enumerate(body.documents) if not document), None)
            if empty is not None:
                raise Refusal(f"documents[{empty}] must not be empty", f"documents[{empty}]")
            if body.top_n is not None and body.top_n < 0:
                raise Refusal(f"top_n must be >= 0 (0: every document), got {body.top_n}", "top_n")
            pairs = [
                _Pair(body.query, document, "query", f"documents[{i}]") for i, document in enumerate(body.documents)
            ]
            inputs, scores = _scored(pairs, pooler)

            def answer(pooled: list[bytes], usage: Usage) -> dict:
                ranked = sorted(enumerate(scores(pooled)), key=lambda item: -item[1])[: body.top_n or None]
                results = [
                    {
                        "index": i,
                        "relevance_score": s,
                        **({"document": {"text": body.documents[i]}} if body.return_documents else {}),
                    }
                    for i, s in ranked
                ]
                return {
                    "id": f"rerank-{uuid.uuid4().hex}",
                    "model": self._model_name(),
                    "results": results,
                    "usage": _usage(usage),
                }

            return body, inputs, answer

        return await self._run(request, "rerank", "rerank-", prepare)

    def _model_name(self) -> str:
        return self.handlers.served.name(0)

    async def _run(
        self,
        request: web.Request,
        endpoint: str,
        id_prefix: str,
        prepare: Callable[[bytes, PoolerConfig], tuple[Body, _Inputs, Answer]],
    ) -> web.Response:
        """One pooling request: `prepare` decodes and checks the body, its inputs and how to answer their vectors."""
        handlers = self.handlers
        rid = f"{id_prefix}{uuid.uuid4().hex}"
        tracker = RequestTracker(rid, endpoint, False, handlers.metrics)
        try:
            if handlers.pooler is None:
                raise Refusal(
                    f"this server generates (--runner generate): it does not answer /v1/{endpoint}; serve "
                    f"an embedding model or a cross-encoder with --runner pooling",
                    "model",
                )
            pooler = handlers.pooler
            body, inputs, answer = prepare(await handlers._read_body(request), pooler)
            requests = _engine_requests(
                rid, inputs, body, handlers.served, handlers.engine.max_context, pair_roles=bool(pooler.logit_tokens)
            )
            handlers._admit(len(requests), 1, "input")
        except Refusal as exc:
            tracker.refused(exc.status, exc.message)
            return refusal_response(exc, rid)
        fanout = Fanout(handlers.engine, choice_requests(rid, requests, 1), 1)
        handlers.in_flight += len(requests)
        try:
            fanout.start()
            pooled, usage = await _gather(fanout, len(requests))
        except _Rejected as exc:
            rejected = exc.rejected
            tracker.refused(rejected.status, rejected.message)
            param = _input_param(rejected.param, inputs.params)
            return request_error(rejected.status, rejected.message, param, rid)
        except EngineFailure as exc:
            tracker.refused(500, str(exc))
            return request_error(500, str(exc), None, rid)
        finally:
            handlers.in_flight -= len(requests)
            if await fanout.close(handlers._abort):
                tracker.client_gone()
        tracker.finished("stop", usage)
        return web.Response(
            body=msgspec.json.encode(answer(pooled, usage)),
            content_type="application/json",
            headers={"X-Request-Id": rid},
        )


def _engine_requests(
    rid: str, inputs: _Inputs, body: Body, served, max_context: int, pair_roles: bool = False
) -> list[GenerateRequest]:
    """One engine request per input, with the body's common fields (model, priority, truncate_prompt_tokens)
    checked (a Refusal naming them); with `pair_roles` (a decoder reranker) a pair is a "query" and a
    "document" message for the chat template."""
    check_model(body.model, served)  # (no adapters: the worker refuses LoRA on the pooling runner)
    priority, keep = body.priority, body.truncate_prompt_tokens
    if priority is not None:
        check_priority(priority)
    if keep is not None and (keep == 0 or keep < -1):
        raise Refusal(f"truncate_prompt_tokens must be -1 (the context) or >= 1, got {keep}", "truncate_prompt_tokens")
    pooling = PoolingParams(truncate_prompt_tokens=max_context if keep == -1 else keep)
    params = RequestParams(stop=StopParams(max_tokens=0), priority=priority or 0, speculative=False, pooling=pooling)
    if pair_roles:
        return [
            GenerateRequest(
                rid=rid,
                messages=[ChatMessage(role="query", content=text), ChatMessage(role="document", content=pair)],
                params=params,
            )
            for text, _, pair in inputs.inputs
        ]
    return [
        GenerateRequest(rid=rid, prompt=text, prompt_token_ids=ids, prompt_pair=pair, params=params)
        for text, ids, pair in inputs.inputs
    ]


class _Pair(NamedTuple):
    """Two texts to score, with the fields that name them in the body."""

    first: str
    second: str
    first_field: str
    second_field: str


def _pairs(text_1: str | list[str], text_2: str | list[str]) -> list[_Pair]:
    """vLLM's pairing: one text with each of a list (either side), or two lists of one length, item by item."""
    sides = []
    for name, value in (("text_1", text_1), ("text_2", text_2)):
        texts = [(value, name)] if isinstance(value, str) else [(t, f"{name}[{i}]") for i, t in enumerate(value)]
        if not texts:
            raise Refusal(f"{name} must not be empty", name)
        empty = next((field for text, field in texts if not text), None)
        if empty is not None:
            raise Refusal(f"{empty} must not be an empty text", empty)
        sides.append(texts)
    firsts, seconds = sides
    if len(firsts) != len(seconds) and 1 not in (len(firsts), len(seconds)):
        raise Refusal(
            f"text_1 and text_2 are lists of different lengths ({len(firsts)} and {len(seconds)}): pair "
            f"one text with a list, or two lists of one length",
            "text_2",
        )
    count = max(len(firsts), len(seconds))
    firsts, seconds = (side * count if len(side) == 1 else side for side in (firsts, seconds))
    return [_Pair(a, b, a_field, b_field) for (a, a_field), (b, b_field) in zip(firsts, seconds)]


def _scored(pairs: list[_Pair], pooler: PoolerConfig) -> tuple[_Inputs, Callable[[list[bytes]], list[float]]]:
    """The inputs scoring `pairs` asks for, and how their vectors score them: a cross-encoder's one input per
    pair (named by its second text, the one a cut shortens), an embedding model's one per distinct text
    (named where it first appears; the pair's score is the cosine of its texts' vectors)."""
    if pooler.kind == "classify":
        inputs = _Inputs([(p.first, None, p.second) for p in pairs], [p.second_field for p in pairs])
        return inputs, lambda pooled: [pooler.score(float(finish_vector(p, None, False)[0])) for p in pooled]
    fields: dict[str, str] = {}
    for pair in pairs:
        fields.setdefault(pair.first, pair.first_field)
        fields.setdefault(pair.second, pair.second_field)
    where = {text: i for i, text in enumerate(fields)}
    inputs = _Inputs([(text, None, None) for text in fields], list(fields.values()))

    def cosines(pooled: list[bytes]) -> list[float]:
        vectors = [finish_vector(p, None, True) for p in pooled]
        return [float(np.dot(vectors[where[p.first]], vectors[where[p.second]])) for p in pairs]

    return inputs, cosines


class _Rejected(Exception):
    def __init__(self, rejected: RequestRejected) -> None:
        self.rejected = rejected


async def _gather(fanout: Fanout, count: int) -> tuple[list[bytes], Usage]:
    """Every input's vector (input order) and their prompt tokens; raises _Rejected, EngineFailure."""
    rejected = await fanout.started()
    if rejected is not None:
        raise _Rejected(rejected)
    pooled: list[bytes] = [b""] * count
    prompt_tokens, left = 0, count
    while left:
        index, event = await fanout.next()
        if isinstance(event, RequestRejected):
            raise _Rejected(event)
        if event.finish_reason is None:
            continue
        if not event.pooled:  # aborted (the server draining, a failed process): nothing pooled
            raise EngineFailure(f"input {index} ended without its vector ({event.finish_reason})")
        pooled[index] = event.pooled
        prompt_tokens += event.usage.prompt_tokens if event.usage else 0
        left -= 1
    return pooled, Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)


def _input_param(param: str | None, params: list[str]) -> str | None:
    """The field of the input an engine refusal names (`prompt` or `messages` with one input, `prompt[i]` or
    `messages[i]` with several)."""
    if param in ("prompt", "messages") and len(params) == 1:
        return params[0]
    name, _, index = (param or "").partition("[")
    if name in ("prompt", "messages") and index.endswith("]"):
        return params[int(index[:-1])]
    return param


def _usage(usage: Usage) -> dict:
    """A pooling answer's usage: its inputs' tokens (it generates none)."""
    return {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}


def _encoded(vector: np.ndarray, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
