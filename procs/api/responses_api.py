"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), built on the chat path.

`ResponsesEndpoint` is what `app.py`'s handlers call: a request is translated into a chat request
(`responses_request.py`) and checked by `validation.validate_chat`, runs as a chat request with one
choice, and `ResponsesShapes` (`responses_shapes.py`) writes the answer as a `response` object or as
typed SSE events; finished responses go to the `ResponseStore` (`responses_store.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from batchserve.procs.api.engine_client import EngineClient
from batchserve.procs.api.responses_request import ResponsesRequest, renamed, response_echo, to_chat
from batchserve.procs.api.responses_shapes import ResponsesShapes
from batchserve.procs.api.responses_store import MemoryResponseStore, ResponseStore, history_message
from batchserve.procs.api.schemas import ChatMessageIn, decode_body
from batchserve.procs.api.served_models import ServedModels
from batchserve.procs.api.stored_response import ResponseStoreError, StoredResponse
from batchserve.procs.api.validation import ValidatedRequest, validate_chat
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.errors import Refusal


class ResponsesEndpoint:
    """`/v1/responses` of one app: translation, validation and the store."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        reasoning: ReasoningFormat = "",
        store: ResponseStore | None = None,
        served: ServedModels | None = None,
    ) -> None:
        self.engine = engine
        self.served = served or ServedModels(engine.model_name)
        self.reasoning = reasoning
        self.store = MemoryResponseStore() if store is None else store

    def prepare(self, body: bytes, rid: str, owner: str = "") -> tuple[ValidatedRequest, ResponsesShapes]:
        req = decode_body(body, ResponsesRequest)
        previous: list[ChatMessageIn] = []
        if req.previous_response_id is not None:
            stored = self._read(req.previous_response_id, owner)
            if stored is None:
                raise Refusal(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    "previous_response_id",
                    code="previous_response_not_found",
                )
            previous = stored.history
        translation = to_chat(req, previous)
        try:
            validated = validate_chat(translation.request, rid=rid, model_name=self.served)
        except Refusal as exc:
            raise renamed(exc, translation.origins) from None
        (generate,) = validated.requests
        params = generate.params
        if params.constraint is not None:
            params = msgspec.structs.replace(
                params, constraint=msgspec.structs.replace(params.constraint, param="text.format")
            )
        generate = msgspec.structs.replace(generate, max_tokens_param="max_output_tokens", params=params)
        validated = dataclasses.replace(validated, requests=[generate])
        store = req.store is not False
        echo = response_echo(req, store)
        history = translation.history

        def keep(response: dict[str, Any]) -> None:
            if not self.store.put(rid, owner, response, [*history, history_message(response["output"])]):
                response["store"] = False  # the answer stands; it was not kept

        shapes = ResponsesShapes(
            rid,
            self.served.name(generate.params.adapter),
            echo=echo,
            logprobs=validated.logprobs,
            tool_names=validated.tool_names,
            reasoning=self.reasoning,
            keep=keep if store else None,
        )
        return validated, shapes

    def retrieve(self, rid: str, request: Any, owner: str = "") -> dict[str, Any]:
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise Refusal("streaming a stored response again is not supported by this server", "stream")
        return self._get(rid, owner).response

    def delete(self, rid: str, request: Any, owner: str = "") -> dict[str, Any]:
        try:
            deleted = self.store.delete(rid, owner)
        except ResponseStoreError as exc:
            raise _unavailable(exc) from None
        if not deleted:
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}

    def _get(self, rid: str, owner: str) -> StoredResponse:
        stored = self._read(rid, owner)
        if stored is None:
            raise _not_found(rid)
        return stored

    def _read(self, rid: str, owner: str) -> StoredResponse | None:
        try:
            return self.store.get(rid, owner)
        except ResponseStoreError as exc:
            raise _unavailable(exc) from None


def _not_found(rid: str) -> Refusal:
    """Absent, expired, or another key's (which is not told apart: ids are not probed across keys)."""
    return Refusal(f"Response with id '{rid}' not found.", "response_id", status=404)


def _unavailable(exc: ResponseStoreError) -> Refusal:
    return Refusal(f"stored responses are unavailable: {exc}", None, status=503, code="store_unavailable")
