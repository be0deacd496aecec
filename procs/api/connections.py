"""How many connections the api holds, and for how long a slow client may keep one.

- `CappedSite`: a TCP site that answers connection number `max_connections` + 1 with an immediate
  503 (an OpenAI error body, `Retry-After`) instead of letting it wait for a file descriptor.
- Headers: aiohttp closes a connection that has not sent a complete request `keepalive_timeout`
  seconds after it opened (or after its previous response), so the runner gets `header_timeout_s`
  as its keep-alive timeout. The body has its own deadline in the handler (`body_timeout_s`).
- `raise_open_file_limit`: the soft RLIMIT_NOFILE up to the hard one, so that the cap decides.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import cast

import msgspec
from aiohttp import web

from batchserve.procs.api.errors import RETRY_AFTER_S, error_body

log = logging.getLogger("batchserve.api")

FDS_KEPT_FREE = 256  # for the engine's sockets, logs and the like, beyond the HTTP connections
LISTEN_BACKLOG = 4096  # connections the kernel queues before we accept them

_BUSY_BODY = msgspec.json.encode(error_body(503, "the server has too many open connections; retry shortly"))
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: " + str(RETRY_AFTER_S).encode() + b"\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


class _Busy(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed without reading the request."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream protocol's transport is a Transport (asyncio's contract; uvloop's too): typeshed types the base
        cast(asyncio.Transport, transport).write(_BUSY_RESPONSE)
        transport.close()


class CappedSite(web.TCPSite):
    """`web.TCPSite` whose protocol factory refuses connections beyond `max_connections`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int) -> None:
        super().__init__(runner, host, port, backlog=LISTEN_BACKLOG)
        self.max_connections = max_connections
        self.refused = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) >= self.max_connections:
                self.refused += 1
                return _Busy()
            return server()

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self._host, self._port, backlog=self._backlog, reuse_address=True
        )


def raise_open_file_limit(wanted_connections: int) -> int:
    """Raise the soft open-file limit to the hard one; returns how many connections it allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    allowed = max(1, soft - FDS_KEPT_FREE)
    if wanted_connections > allowed:
        log.warning(
            "max_connections %d exceeds what %d open files allow; capping at %d", wanted_connections, soft, allowed
        )
    return min(wanted_connections, allowed)
