"""vLLM's `/tokenize` and `/detokenize` endpoints."""

from __future__ import annotations

from aiohttp import web


def add_tokenize_routes(app: web.Application, handlers) -> None:
    """Register `/tokenize` and `/detokenize` on the api's application."""
