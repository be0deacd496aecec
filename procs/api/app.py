"""The OpenAI-compatible HTTP application: `create_app(engine, config)`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), POST /v1/responses and
GET/DELETE /v1/responses/{id} (OpenAI's Responses API on the chat path: `responses_api.py`),
GET /v1/models, GET /health, GET /metrics, the live view's GET /dashboard/snapshot (`live_view.py`) and,
unless --no-webui, the web pages (`webui.py`). Every error is an OpenAI error body (`errors.py`).

A request's life here: API key (401, when keys are configured) -> JSON body within
`body_timeout_s` (408; a missing or other Content-Type, a Content-Encoding aiohttp does not decode
or a body not valid in its encoding: 400, the last two closing the connection) -> decode + validate
(400 names the field) -> admission (503 + Retry-After
when the engine cannot serve or `max_running_requests + max_waiting` requests are already in flight
at the api; a request counts once per choice) -> `engine.generate` for every choice (`Fanout`) ->
wait for every choice's first event, so that an engine rejection is still a plain 400/503 -> JSON
answer, or SSE headers and chunks. If the engine fails once the stream has started (a backend died
or stalled, or the drain ran out), the stream ends with a chunk per unfinished choice whose
finish_reason is "abort", an error event and [DONE]. Every choice that did not end normally
(client disconnected, broken stream, engine error) gets `engine.abort(rid)` once, in the `finally`.
Disconnects are seen two ways: aiohttp cancels the handler (`handler_cancellation=True`, which
`start_api` and aiohttp's TestServer set) or a write raises ConnectionResetError.

Chat answers to requests with tools, and with `reasoning` on, are parsed into `tool_calls` and
`reasoning_content` (`chat_output.py`, through `ChatShapes`). The shapes object of an endpoint
(`responses.py`) also frames its stream: the start, each delta's bytes, the end and a failure.

Choices (`n`, and a completion's batch of prompts): each is its own engine request, rid
f"{rid}-{index}" (the HTTP request's rid when there is one choice), index = prompt_index * n + j.
With a seed, choice j of a prompt samples with `choice_seed(seed, j)`: j = 0 keeps the seed, so n=1
is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable

import msgspec
from aiohttp import hdrs, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestPayloadError

from batchserve.procs.api.auth import OWNER, accepted_keys, auth_middleware
from batchserve.procs.api.engine_client import EngineClient
from batchserve.procs.api.errors import BodyError, error_response, refusal_response, request_error
from batchserve.procs.api.fanout import EngineFailure, Fanout, choice_requests
from batchserve.procs.api.live_view import LiveView
from batchserve.procs.api.lora_api import add_lora_routes
from batchserve.procs.api.metrics import ApiMetrics
from batchserve.procs.api.openapi import DOCUMENT_KEY, ServedDocument, serve_document, server_facts
from batchserve.procs.api.pooling_api import add_pooling_routes
from batchserve.procs.api.responses import ChatShapes, ChoiceOutput, CompletionShapes, ResponseShapes, total_usage
from batchserve.procs.api.responses_api import ResponsesEndpoint
from batchserve.procs.api.responses_store import UnavailableResponseStore, serving_store
from batchserve.procs.api.schemas import ChatCompletionRequest, CompletionRequest, decode_body
from batchserve.procs.api.served_models import ServedModels
from batchserve.procs.api.tokenize_api import add_tokenize_routes
from batchserve.procs.api.tracking import RequestTracker
from batchserve.procs.api.validation import ValidatedRequest, validate_chat, validate_completion
from batchserve.procs.api.webui import add_webui_routes
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.config import ServerConfig, request_cap
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import RequestRejected, SchedulerStats
from batchserve.shared.pooling import PoolerConfig

logger = logging.getLogger("batchserve.api")

MAX_BODY_BYTES = 16 * 1024 * 1024  # a long prompt as a JSON list of token ids stays well under this
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Content-Encodings of a request body that aiohttp decodes (br with the brotli package, zstd with
# backports.zstd or Python 3.14); any other would reach the JSON decoder still encoded.
DECODED_ENCODINGS = frozenset(
    {"identity", "gzip", "deflate", *(("br",) if HAS_BROTLI else ()), *(("zstd",) if HAS_ZSTD else ())}
)


STORED_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,256}")  # what a stored response's id can be


class ApiHandlers:
    def __init__(
        self,
        engine: EngineClient,
        config: ServerConfig,
        *,
        reasoning: ReasoningFormat = "",
        pooler: PoolerConfig | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.pooler = pooler  # the pooling runner's (`/v1/embeddings`); None: the generate runner
        self.reasoning = reasoning  # chat answers: <think>...</think> goes to reasoning_content
        self.metrics = ApiMetrics(config.objectives)
        self.live_view = LiveView(self.metrics)  # /dashboard's data
        # A request in flight is running or waiting in the scheduler, so this caps the waiting queue.
        self.max_in_flight = request_cap(config.max_running_requests, config.max_waiting)
        self.in_flight = 0
        self.created = int(time.time())
        self.served = ServedModels.of(engine.model_name, config)  # the model and its LoRA adapters
        self.metrics.lora.max_loras, self.metrics.lora.name_of = (
            config.max_loras if config.enable_lora else 0,
            self.served.name,
        )
        self.responses = ResponsesEndpoint(
            engine,
            reasoning=reasoning,
            served=self.served,
            store=serving_store(config.responses_store, config.responses_ttl_s),
        )

    # ---- plain endpoints

    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.metrics.observe_scheduler_stats(stats)
        self.live_view.observe(stats)

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": self.served.cards(self.created, self.engine.max_context)})

    async def health(self, request: web.Request) -> web.Response:
        problem = self.engine.health_problem()
        # a store that did not open is reported, but generation is served (200): a router keeps the replica
        store = self.responses.store
        extra = {"responses_store": store.name} if isinstance(store, UnavailableResponseStore) else {}
        if problem is None:
            return _json({"status": "ok", **extra})
        return _json({"status": "unavailable", "reason": problem, **extra}, status=503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        self.metrics.in_flight.set(self.in_flight)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    # ---- generation endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(
            request, "completions", "cmpl-", CompletionRequest, validate_completion, CompletionShapes
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "chatcmpl-", ChatCompletionRequest, validate_chat, ChatShapes)

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        owner = request.get(OWNER, "")
        return await self._run(
            request, "responses", "resp_", lambda body, rid: self.responses.prepare(body, rid, owner)
        )

    async def get_response(self, request: web.Request) -> web.Response:
        return self._stored(request, self.responses.retrieve)

    async def delete_response(self, request: web.Request) -> web.Response:
        return self._stored(request, self.responses.delete)

    def _stored(self, request: web.Request, action: Callable[[str, web.Request, str], dict]) -> web.Response:
        rid = request.match_info["response_id"]
        if not STORED_ID_RE.fullmatch(rid):  # no id this server makes; not echoed in a header either
            return error_response(404, "No response found with that id.", "response_id")
        try:
            return _json(action(rid, request, request.get(OWNER, "")), rid=rid)
        except Refusal as exc:
            return request_error(exc.status, exc.message, exc.param, rid, exc.code)

    async def _generate(
        self,
        request: web.Request,
        endpoint: str,
        id_prefix: str,
        schema: type,
        validate: Callable[..., ValidatedRequest],
        shapes_cls: type[ResponseShapes],
    ) -> web.StreamResponse:
        def prepare(body: bytes, rid: str) -> tuple[ValidatedRequest, ResponseShapes]:
            validated = validate(decode_body(body, schema), rid=rid, model_name=self.served)
            model = self.served.name(validated.requests[0].params.adapter)  # the answer names what it ran
            shapes = shapes_cls(
                rid,
                model,
                validated.include_usage,
                validated.logprobs,
                tool_names=validated.tool_names,
                reasoning=self.reasoning if endpoint == "chat" else "",
            )
            return validated, shapes

        return await self._run(request, endpoint, id_prefix, prepare)

    async def _run(
        self,
        request: web.Request,
        endpoint: str,
        id_prefix: str,
        prepare: Callable[[bytes, str], tuple[ValidatedRequest, ResponseShapes]],
    ) -> web.StreamResponse:
        """One generation request: `prepare` decodes and validates the body into the engine requests
        and the shapes of the answer."""
        rid = f"{id_prefix}{uuid.uuid4().hex}"
        tracker = RequestTracker(rid, endpoint, False, self.metrics)
        try:
            if self.pooler is not None:
                raise Refusal(
                    f"this server pools (--runner pooling): it answers /v1/embeddings, not /v1/{endpoint}; "
                    f"serve a generative model with --runner generate",
                    "model",
                )
            body = await self._read_body(request)
            validated, shapes = prepare(body, rid)
            tracker.stream = validated.stream
            adapter = validated.requests[0].params.adapter
            tracker.adapter = self.served.name(adapter) if adapter else ""
            self._admit(len(validated.requests), validated.n)
        except Refusal as exc:
            tracker.refused(exc.status, exc.message)
            return refusal_response(exc, rid)

        choices = _choice_outputs(validated)
        fanout = Fanout(self.engine, choice_requests(rid, validated.requests, validated.n), validated.n)
        self.in_flight += len(choices)
        try:
            fanout.start()
            rejected = await fanout.started()
            if rejected is not None:
                tracker.refused(rejected.status, rejected.message)
                return request_error(rejected.status, rejected.message, shapes.engine_param(rejected.param), rid)
            if validated.stream:
                return await self._stream(request, fanout, choices, shapes, tracker)
            return await self._whole(fanout, choices, shapes, tracker)
        except EngineFailure as exc:
            tracker.refused(500, str(exc))
            return request_error(500, str(exc), None, rid)
        finally:
            self.in_flight -= len(choices)
            if await fanout.close(self._abort):
                tracker.client_gone()

    async def _read_body(self, request: web.Request) -> bytes:
        if request.headers.get(hdrs.CONTENT_TYPE) is None:
            raise Refusal(
                "the Content-Type header is missing: send the body as JSON with Content-Type: application/json"
            )
        if request.content_type != "application/json":
            raise Refusal(f"Content-Type must be application/json (got {request.content_type})")
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").lower()  # as aiohttp reads it
        if encoding not in DECODED_ENCODINGS:
            raise BodyError(
                f"Content-Encoding {encoding!r} is not supported: send the body as it is (identity) "
                f"or encoded with one of {', '.join(sorted(DECODED_ENCODINGS - {'identity'}))}"
            )
        try:
            return await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except TimeoutError:
            raise Refusal(
                f"the request body did not arrive within {self.config.body_timeout_s:g} s", status=408
            ) from None
        except RequestPayloadError as exc:  # not valid in its Content-Encoding, or cut off
            # Nothing more of it can be read: end it, or aiohttp would read on after the answer (to
            # linger) and log the same error as an unhandled one. The answer closes the connection.
            request.content.feed_eof()
            cause = exc.__cause__
            if isinstance(cause, ContentEncodingError):
                raise BodyError(
                    f"the request body is not valid {encoding} (its Content-Encoding): "
                    f"{cause.__cause__ or cause.__context__ or cause.message}"
                ) from None
            raise BodyError(f"the request body could not be read: {cause or exc}") from None

    def _admit(self, prompts: int, n: int, field: str = "prompt") -> None:
        """Room for `prompts` x `n` engine requests (a 400 naming `n`, or `field`, the prompts' or inputs'
        field, when there never is; a 503 while there is none now)."""
        count = prompts * n
        cap = self.max_in_flight
        if cap is not None and count > cap:  # could never fit: retrying would not help
            raise Refusal(
                f"this request asks for {count} sequences ({prompts} {field}s x n={n}); this server "
                f"runs at most {cap} at once (--max-running-requests + --max-waiting)",
                "n" if n > 1 else field,
            )
        problem = self.engine.health_problem()
        if problem is not None:
            raise Refusal(f"the server cannot take requests now ({problem}); retry shortly", status=503)
        if cap is not None and self.in_flight + count > cap:
            raise Refusal(f"the server is at capacity ({self.in_flight} choices in flight); retry shortly", status=503)

    async def _abort(self, rid: str) -> None:
        # Shielded: the handler may be being cancelled (client gone), and the abort must still go out.
        try:
            await asyncio.shield(self.engine.abort(rid))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("abort of %s failed", rid)

    async def _whole(
        self, fanout: Fanout, choices: list[ChoiceOutput], shapes: ResponseShapes, tracker: RequestTracker
    ) -> web.Response:
        """Non-streaming: gather every choice, answer one JSON object."""
        unfinished = len(choices)
        while unfinished:
            index, event = await fanout.next()
            if isinstance(event, RequestRejected):
                tracker.refused(event.status, event.message)
                return request_error(event.status, event.message, shapes.engine_param(event.param), shapes.rid)
            tracker.on_delta(event, timed=index == 0)
            choices[index].add(event)
            unfinished -= event.finish_reason is not None
        usage = total_usage(choices)
        body = shapes.full(choices, usage)  # may turn a finish_reason into "tool_calls"
        tracker.finished(choices[0].finish_reason or "stop", usage)
        return _json(body, rid=shapes.rid)

    async def _stream(
        self,
        request: web.Request,
        fanout: Fanout,
        choices: list[ChoiceOutput],
        shapes: ResponseShapes,
        tracker: RequestTracker,
    ) -> web.StreamResponse:
        """SSE. A write to a vanished client raises ConnectionResetError; `_generate`'s finally aborts."""
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": shapes.rid})
        await response.prepare(request)
        start = shapes.stream_start(choices)
        if start:
            await response.write(start)
        unfinished = len(choices)
        while unfinished:
            try:
                index, event = await fanout.next()
            except EngineFailure as exc:
                # Headers are gone already: the error travels as an SSE event, then the stream ends.
                tracker.refused(500, str(exc))
                await response.write(shapes.stream_failure([], 500, str(exc), None))
                break
            if isinstance(event, RequestRejected):  # mid-stream: the engine failed, or the drain ran out
                tracker.refused(event.status, event.message)
                await response.write(
                    shapes.stream_failure(
                        [c for c in choices if c.finish_reason is None],
                        event.status,
                        event.message,
                        shapes.engine_param(event.param),
                    )
                )
                break
            tracker.on_delta(event, timed=index == 0)
            choice = choices[index]
            piece = choice.add(event)
            out = shapes.stream_bytes(choice, piece)
            if choice.finish_reason is not None:
                unfinished -= 1
                if not unfinished:
                    usage = total_usage(choices)
                    tracker.finished(choices[0].finish_reason or "stop", usage)
                    out += shapes.stream_end(choices, usage)
            if out:
                await response.write(out)
        await response.write_eof()
        return response


def _choice_outputs(validated: ValidatedRequest) -> list[ChoiceOutput]:
    choices: list[ChoiceOutput] = []
    for index in range(len(validated.requests) * validated.n):
        leader = None if index % validated.n == 0 else choices[index - index % validated.n]
        choices.append(
            ChoiceOutput(
                index,
                leader=leader,
                echo=validated.echo,
                drop_generated=validated.drop_generated,
                collect=not validated.stream,
            )
        )
    return choices


def _json(obj, status: int = 200, rid: str | None = None) -> web.Response:
    headers = {"X-Request-Id": rid} if rid else None
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json", headers=headers)


@web.middleware
async def openai_error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413, a crash) as OpenAI error bodies instead of text/HTML."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # a 413's text says the limit; aiohttp's HTTPRequestEntityTooLarge always gives one
        response = error_response(exc.status, exc.text if exc.status == 413 and exc.text is not None else exc.reason)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal server error")


HANDLERS_KEY: web.AppKey[ApiHandlers] = web.AppKey("batchserve_api_handlers", ApiHandlers)


def create_app(
    engine: EngineClient, config: ServerConfig, *, reasoning: ReasoningFormat = "", pooler: PoolerConfig | None = None
) -> web.Application:
    """The api's aiohttp application around `engine` (see `engine_client.py` for the contract).
    `reasoning`: the model thinks in <think> blocks (`ChatFormat.reasoning`), which chat answers then
    report as `reasoning_content`. `pooler`: the model is served by the pooling runner, this way
    (`shared.pooling`): `/v1/embeddings` answers, the generation endpoints refuse."""
    handlers = ApiHandlers(engine, config, reasoning=reasoning, pooler=pooler)
    engine.set_stats_listener(handlers.observe_scheduler_stats)
    keys = accepted_keys(config)
    middlewares: list[Middleware] = [openai_error_middleware, *([auth_middleware(keys)] if keys else [])]
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[HANDLERS_KEY] = handlers
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/responses", handlers.create_response)
    app.router.add_get("/v1/responses/{response_id}", handlers.get_response)
    app.router.add_delete("/v1/responses/{response_id}", handlers.delete_response)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics_page)
    app.router.add_get("/dashboard/snapshot", handlers.live_view.handle)
    app[DOCUMENT_KEY] = ServedDocument(server_facts(engine, config, pooler), handlers.served)
    app.router.add_get("/openapi.json", serve_document)
    if config.webui:
        add_webui_routes(app)
    add_tokenize_routes(app, handlers)
    add_pooling_routes(app, handlers)
    if config.enable_lora_runtime_updates:
        add_lora_routes(app, handlers)

    start = getattr(engine, "start", None)
    close = getattr(engine, "close", None)
    if start is not None:

        async def _start_engine(app: web.Application) -> None:
            await start()

        app.on_startup.append(_start_engine)
    if close is not None:

        async def _close_engine(app: web.Application) -> None:
            await close()

        app.on_cleanup.append(_close_engine)
    return app
