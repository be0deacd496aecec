"""API keys: `/v1/*` needs `Authorization: Bearer <key>` when any key is configured.

`/health` and `/metrics` stay open (load balancers and Prometheus call them without a key).
Keys come from `--api-key` / `BATCHSERVE_API_KEY` and `--api-key-file` (one per line); they are
compared in constant time.

Behind a router, a replica's api also takes the router's internal key (`INTERNAL_KEY_ENV`, set by
`batchserve serve` in the api's and the router's environment, or by the units' `internal-key.env`):
the key smg presents to the replicas and the only key of its control plane, which no client is given
(procs/router.py). It never replaces the clients' keys, and a server without keys stays open.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from batchserve.procs.api.errors import error_body
from batchserve.procs.api.responses_store import owner_of
from batchserve.shared.config import ServerConfig

# Every OpenAI path, the pooling runner's vLLM and Jina aliases (`/score`, `/rerank`, `/v2/rerank`) and the
# live view's data; the web pages' own files stay open (they ask for a key and send it with every call).
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/score", "/rerank", "/dashboard/snapshot")
# The router's internal key, in the environment of the router and of the replicas' apis (never a flag:
# a command line is readable by every user of the machine).
INTERNAL_KEY_ENV = "BATCHSERVE_INTERNAL_KEY"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OWNER = web.RequestKey("owner", str)  # a hash of the API key a request presented ("" without keys; `owner_of`)


def load_api_keys(config: ServerConfig) -> tuple[bytes, ...]:
    """Every configured key; raises ValueError (a CLI message) for an unreadable file or an empty key."""
    keys = list(config.api_key)
    if config.api_key_file:
        try:
            text = Path(config.api_key_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"api_key_file {config.api_key_file}: {exc.strerror or exc}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"api_key_file {config.api_key_file}: no keys in it")
    if any(not key or any(c.isspace() for c in key) for key in keys):
        raise ValueError("an API key is empty or contains whitespace")
    return tuple(key.encode() for key in keys)


def new_internal_key() -> str:
    """A fresh internal key (256 random bits, URL-safe: it travels in an Authorization header)."""
    return secrets.token_urlsafe(32)


def internal_key(env: dict[str, str] | None = None) -> str | None:
    """The router's internal key from the environment (`INTERNAL_KEY_ENV`), if set."""
    key = (os.environ if env is None else env).get(INTERNAL_KEY_ENV, "").strip()
    return key or None


def accepted_keys(config: ServerConfig, env: dict[str, str] | None = None) -> tuple[bytes, ...]:
    """What the api checks `/v1/*` against: the configured keys, and the router's internal key when
    there are any (without client keys the api is open, and smg then sends it no key)."""
    keys = load_api_keys(config)
    internal = internal_key(env)
    return keys + (internal.encode(),) if keys and internal else keys


def _unauthorized(message: str) -> web.Response:
    body = error_body(401, message)
    body["error"]["code"] = "invalid_api_key"
    return web.Response(
        status=401,
        body=msgspec.json.encode(body),
        content_type="application/json",
        headers={"WWW-Authenticate": "Bearer"},
    )


def auth_middleware(keys: tuple[bytes, ...]) -> Middleware:
    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIXES):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                return _unauthorized("You didn't provide an API key: send `Authorization: Bearer <key>`.")
            token = given.strip().encode()
            # compare_digest against every key (no early exit that would time which one matched)
            if not sum(hmac.compare_digest(token, key) for key in keys):
                return _unauthorized("Incorrect API key provided.")
            request[OWNER] = owner_of(token.decode())  # whose stored responses it may see
        return await handler(request)

    return check_api_key
