"""vLLM's `/tokenize` and `/detokenize` endpoints.

`POST /tokenize` takes vLLM's two request shapes: `{"prompt": text, "add_special_tokens"}` or
`{"messages": [...], "add_generation_prompt", "continue_final_message", "add_special_tokens",
"chat_template_kwargs", "tools"}`, both with `return_token_strs`, and answers `{"count",
"max_model_len", "tokens", "token_strs"}`. The prompt or messages go through the same validation as
a completion's or a chat's (`validate_completion` / `validate_chat`: the same fields, the same
refusals) and are tokenized by the engine on generation's own path (the tokenizer process, chat
template and tools included), so the ids are exactly those a generation would feed. `POST
/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": text}`; an id outside the vocabulary
is a 400 naming `tokens`. Both answer the engine's refusals as OpenAI error bodies, and 503 while the
engine cannot serve.
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from batchserve.procs.api.errors import error_response
from batchserve.procs.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
    decode_body,
)
from batchserve.procs.api.validation import check_model, validate_chat, validate_completion
from batchserve.shared.checks import MAX_TOKEN_ID
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import GenerateRequest


def add_tokenize_routes(app: web.Application, handlers) -> None:
    """Register `/tokenize` and `/detokenize` on the api's application (`handlers`: its `ApiHandlers`)."""
    routes = _TokenizeRoutes(handlers)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)


class _TokenizeRoutes:
    def __init__(self, handlers) -> None:
        self.handlers = handlers
        self.engine = handlers.engine

    async def tokenize(self, request: web.Request) -> web.Response:
        rid = f"tok-{uuid.uuid4().hex}"
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            query = decode_body(body, TokenizeBody)
            generate = self._prompt_request(query, rid)
            continue_final = bool(query.continue_final_message)
            if continue_final and query.add_generation_prompt:
                raise Refusal(
                    "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
                )
            add_generation_prompt = (
                not continue_final if query.add_generation_prompt is None else query.add_generation_prompt
            )
            tokens = await self.engine.tokenize(
                generate,
                add_special_tokens=query.add_special_tokens,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                return_token_strs=bool(query.return_token_strs),
            )
        except Refusal as exc:
            return _error(exc)
        return _json(
            {
                "count": len(tokens.ids),
                "max_model_len": self.engine.max_context,
                "tokens": tokens.ids,
                "token_strs": tokens.strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            query = decode_body(body, DetokenizeBody)
            check_model(query.model, self.handlers.served)
            if any(not 0 <= t <= MAX_TOKEN_ID for t in query.tokens):
                raise Refusal(f"tokens must be token ids in [0, {MAX_TOKEN_ID}]", "tokens")
            text = await self.engine.detokenize(list(query.tokens))
        except Refusal as exc:
            return _error(exc)
        return _json({"prompt": text})

    async def _body(self, request: web.Request) -> bytes | web.Response:
        """The body as the generation endpoints read it (Content-Type, encodings, the body timeout)."""
        try:
            return await self.handlers._read_body(request)
        except Refusal as exc:
            response = _error(exc)
            response.force_close()  # the rest of the body may be unread
            return response

    def _prompt_request(self, query: TokenizeBody, rid: str) -> GenerateRequest:
        """The engine request a completion (`prompt`) or a chat (`messages`) with these fields makes."""
        if (query.prompt is None) == (query.messages is None):
            raise Refusal(
                "give exactly one of prompt (a text) and messages (a chat)",
                "prompt" if query.prompt is None else "messages",
            )
        if query.prompt is not None:
            validated = validate_completion(
                CompletionRequest(model=query.model, prompt=query.prompt), rid=rid, model_name=self.handlers.served
            )
        else:
            chat = ChatCompletionRequest(
                model=query.model,
                messages=query.messages or [],
                tools=query.tools,
                chat_template_kwargs=query.chat_template_kwargs,
            )
            validated = validate_chat(chat, rid=rid, model_name=self.handlers.served)
        return validated.requests[0]


def _error(exc: Refusal) -> web.Response:
    return error_response(exc.status, exc.message, exc.param, exc.code)


def _json(obj: dict) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
