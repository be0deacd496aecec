"""The OpenAI-compatible HTTP application: `create_app(engine, config)`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
GET /health, GET /metrics. Every error is an OpenAI error body (`errors.py`).

A request's life here: API key (401, when keys are configured) -> JSON body within
`body_timeout_s` (408) -> decode + validate (400 names the field) -> admission (503 + Retry-After
when the engine cannot serve or `max_running_requests + max_waiting` requests are already in flight
at the api) -> `engine.generate` -> wait for the first event, so that an engine rejection is still a
plain 400/503 -> JSON answer, or SSE headers and chunks. If the engine fails once the stream has
started (a backend died or stalled, or the drain ran out), the stream ends with a chunk whose
finish_reason is "abort", an error event and [DONE]. If the request did not end normally
(client disconnected, broken stream, engine error) the `finally` sends `engine.abort(rid)` once.
Disconnects are seen two ways: aiohttp cancels the handler (`handler_cancellation=True`, which
`run_api` and aiohttp's TestServer set) or a write raises ConnectionResetError.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import msgspec
from aiohttp import web

from procs.api.auth import auth_middleware, load_api_keys
from procs.api.engine_client import EngineClient, EngineEvent
from procs.api.errors import ApiError, error_body, error_response
from procs.api.metrics import ApiMetrics
from procs.api.responses import SSE_DONE, ChatShapes, CompletionShapes, ResponseShapes, sse_event
from procs.api.schemas import ChatCompletionRequest, CompletionRequest, decode_body
from procs.api.tracking import RequestTracker
from procs.api.validation import ValidatedRequest, validate_chat, validate_completion
from shared.config import ServerConfig
from shared.messages import RequestRejected, TextDelta, Usage

logger = logging.getLogger("batchserve.api")

MAX_BODY_BYTES = 16 * 1024 * 1024  # a long prompt as a JSON list of token ids stays well under this
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EngineFailure(Exception):
    """The engine client raised, or its stream ended without a finish_reason."""


class _Run:
    """One request in the engine: its event stream, and whether the engine is done with it."""

    def __init__(self, rid: str, events: AsyncIterator[EngineEvent]) -> None:
        self.rid = rid
        self.events = events
        self.ended = False  # a finish_reason or a rejection arrived: no abort needed

    async def next_event(self) -> EngineEvent:
        try:
            event = await self.events.__anext__()
        except StopAsyncIteration:
            raise EngineFailure("the engine ended the request without a finish reason") from None
        except Exception as exc:  # the engine client is broken: answer 500, never a traceback
            logger.exception("engine client failed for %s", self.rid)
            raise EngineFailure(f"engine error: {exc}") from None
        if isinstance(event, RequestRejected) or event.finish_reason is not None:
            self.ended = True
        return event

    async def close(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()


class ApiHandlers:
    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ApiMetrics()
        # A request in flight is running or waiting in the scheduler, so this caps the waiting queue.
        self.max_in_flight = config.max_running_requests + config.max_waiting
        self.in_flight = 0
        self.created = int(time.time())

    # ---- plain endpoints

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.engine.model_name, "object": "model", "created": self.created,
                "owned_by": "batchserve", "max_model_len": self.engine.max_context}
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        problem = self.engine.health_problem()
        if problem is None:
            return _json({"status": "ok"})
        return _json({"status": "unavailable", "reason": problem}, status=503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        self.metrics.in_flight.set(self.in_flight)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    # ---- generation endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", "cmpl", CompletionRequest, validate_completion,
                                    CompletionShapes)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "chatcmpl", ChatCompletionRequest, validate_chat, ChatShapes)

    async def _generate(self, request: web.Request, endpoint: str, id_prefix: str, schema: type,
                        validate: Callable[..., ValidatedRequest],
                        shapes_cls: type[ResponseShapes]) -> web.StreamResponse:
        rid = f"{id_prefix}-{uuid.uuid4().hex}"
        tracker = RequestTracker(rid, endpoint, False, self.metrics)
        try:
            body = await self._read_body(request)
            validated = validate(decode_body(body, schema), rid=rid, model_name=self.engine.model_name,
                                 max_context=self.engine.max_context)
            tracker.stream = validated.stream
            self._admit()
        except ApiError as exc:
            tracker.refused(exc.status, exc.message)
            response = _error(exc.status, exc.message, exc.param, rid)
            if exc.status == 408:
                response.force_close()  # the rest of the body is not worth waiting for
            return response

        shapes = shapes_cls(rid, self.engine.model_name, validated.include_usage)
        self.in_flight += 1
        run = _Run(rid, self.engine.generate(validated.generate))
        try:
            first = await run.next_event()
            if isinstance(first, RequestRejected):
                tracker.refused(first.status, first.message)
                return _error(first.status, first.message, first.param, rid)
            if validated.stream:
                return await self._stream(request, run, first, shapes, tracker)
            return await self._whole(run, first, shapes, tracker)
        except EngineFailure as exc:
            tracker.refused(500, str(exc))
            return _error(500, str(exc), None, rid)
        finally:
            self.in_flight -= 1
            if not run.ended:
                tracker.client_gone()
                await self._abort(rid)
            await run.close()

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_type != "application/json":
            raise ApiError(400, f"Content-Type must be application/json (got {request.content_type})")
        try:
            return await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s") from None

    def _admit(self) -> None:
        problem = self.engine.health_problem()
        if problem is not None:
            raise ApiError(503, f"the server cannot take requests now ({problem}); retry shortly")
        if self.in_flight >= self.max_in_flight:
            raise ApiError(503, f"the server is at capacity ({self.in_flight} requests in flight); retry shortly")

    async def _abort(self, rid: str) -> None:
        # Shielded: the handler may be being cancelled (client gone), and the abort must still go out.
        try:
            await asyncio.shield(self.engine.abort(rid))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("abort of %s failed", rid)

    async def _whole(self, run: _Run, first: TextDelta, shapes: ResponseShapes,
                     tracker: RequestTracker) -> web.Response:
        """Non-streaming: gather the text, answer one JSON object."""
        parts: list[str] = []
        event: EngineEvent = first
        while True:
            if isinstance(event, RequestRejected):
                tracker.refused(event.status, event.message)
                return _error(event.status, event.message, event.param, run.rid)
            tracker.on_delta(event)
            parts.append(event.text)
            if event.finish_reason is not None:
                usage = _usage(event, tracker)
                tracker.finished(event.finish_reason, usage)
                return _json(shapes.full("".join(parts), event.finish_reason, usage), rid=run.rid)
            event = await run.next_event()

    async def _stream(self, request: web.Request, run: _Run, first: TextDelta, shapes: ResponseShapes,
                      tracker: RequestTracker) -> web.StreamResponse:
        """SSE. A write to a vanished client raises ConnectionResetError; `_generate`'s finally aborts."""
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": run.rid})
        await response.prepare(request)
        start = shapes.start_chunk()
        if start is not None:
            await response.write(sse_event(start))
        event: EngineEvent = first
        while True:
            if isinstance(event, RequestRejected):  # mid-stream: the engine failed, or the drain ran out
                tracker.refused(event.status, event.message)
                await response.write(sse_event(shapes.finish_chunk("abort"))
                                     + sse_event(error_body(event.status, event.message, event.param)) + SSE_DONE)
                break
            tracker.on_delta(event)
            if event.text:
                await response.write(sse_event(shapes.text_chunk(event.text)))
            if event.finish_reason is not None:
                usage = _usage(event, tracker)
                tracker.finished(event.finish_reason, usage)
                tail = sse_event(shapes.finish_chunk(event.finish_reason))
                if shapes.include_usage:
                    tail += sse_event(shapes.usage_chunk(usage))
                await response.write(tail + SSE_DONE)
                break
            try:
                event = await run.next_event()
            except EngineFailure as exc:
                # Headers are gone already: the error travels as an SSE event, then the stream ends.
                tracker.refused(500, str(exc))
                await response.write(sse_event(error_body(500, str(exc))) + SSE_DONE)
                break
        await response.write_eof()
        return response


def _usage(final: TextDelta, tracker: RequestTracker) -> Usage:
    if final.usage is not None:
        return final.usage
    # The engine should always send usage with the last delta; count what was delivered if not.
    return Usage(prompt_tokens=0, completion_tokens=tracker.completion_tokens,
                 total_tokens=tracker.completion_tokens)



def _json(obj, status: int = 200, rid: str | None = None) -> web.Response:
    headers = {"X-Request-Id": rid} if rid else None
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json",
                        headers=headers)


def _error(status: int, message: str, param: str | None, rid: str) -> web.Response:
    response = error_response(status, message, param)
    response.headers["X-Request-Id"] = rid
    return response


@web.middleware
async def openai_error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413, a crash) as OpenAI error bodies instead of text/HTML."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.reason if exc.status != 413 else exc.text)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal server error")


HANDLERS_KEY: web.AppKey[ApiHandlers] = web.AppKey("batchserve_api_handlers", ApiHandlers)


def create_app(engine: EngineClient, config: ServerConfig) -> web.Application:
    """The api's aiohttp application around `engine` (see `engine_client.py` for the contract)."""
    handlers = ApiHandlers(engine, config)
    engine.set_stats_listener(handlers.metrics.observe_scheduler_stats)
    keys = load_api_keys(config)
    middlewares = [openai_error_middleware, *([auth_middleware(keys)] if keys else [])]
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[HANDLERS_KEY] = handlers
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics_page)

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
