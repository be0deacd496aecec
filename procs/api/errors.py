"""OpenAI-style error answers: `{"error": {"message", "type", "param", "code"}}`, for a `Refusal`
(`shared/errors.py`) or any other error status."""

from __future__ import annotations

import msgspec
from aiohttp import web

from batchserve.shared.errors import Refusal

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before retrying

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.Response(
        status=status,
        body=msgspec.json.encode(error_body(status, message, param, code)),
        content_type="application/json",
        headers=headers,
    )


def request_error(status: int, message: str, param: str | None, rid: str, code: str | None = None) -> web.Response:
    """`error_response` for the request `rid`, which its X-Request-Id header names."""
    response = error_response(status, message, param, code)
    response.headers["X-Request-Id"] = rid
    return response


class BodyError(Refusal):
    """The body cannot be decoded: a 400 that also closes the connection (the rest of it is unread)."""


def refusal_response(exc: Refusal, rid: str) -> web.Response:
    """A refused request's answer; the connection closes after a body that timed out or cannot be read (the
    rest of it is not worth waiting for)."""
    response = request_error(exc.status, exc.message, exc.param, rid, exc.code)
    if exc.status == 408 or isinstance(exc, BodyError):
        response.force_close()
    return response
