"""How many connections the api holds, and for how long a slow client may keep one.

- `CappedSite`: a TCP site that answers connection number `max_connections` + 1 with an immediate
  503 (an OpenAI error body, `Retry-After`) instead of letting it wait for a file descriptor.
- `ConnectionHandler`: aiohttp's request handler, logging a malformed request at INFO, with a deadline
  for each request's headers (`header_timeout_s`, from the connection's start or from the first byte
  of a later request), beside
  aiohttp's own idle timer (`keep_alive_timeout_s`): aiohttp has one timer for both, and a keep-alive
  longer than a load balancer's (60 s) would otherwise also give a slowloris client that long. The
  body has its own deadline in the handler (`body_timeout_s`).
- `raise_open_file_limit`: the soft RLIMIT_NOFILE up to the hard one, so that the cap decides.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, cast

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

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


class ConnectionHandler(RequestHandler):
    """aiohttp's handler of one connection, with a header deadline and quiet refusals.

    A malformed request line or header (a 20 KB path, a bad header) is the client's error: answered 400
    by aiohttp and logged here at INFO, without the traceback aiohttp logs at ERROR.

    A request's headers must arrive within `header_timeout` seconds: from the connection's start for
    its first request, from the first byte of each later one. An idle keep-alive connection is
    aiohttp's to close (`keepalive_timeout`). Reads aiohttp's own counters (`_request_count`: requests
    whose headers it parsed; `_request_in_progress`; `_messages`: parsed, not yet handled):
    tests/test_api_keep_alive.py fails if they change meaning."""

    __slots__ = ("_header_timeout", "_header_deadline", "_armed_at")

    def __init__(self, *args: object, header_timeout: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # aiohttp's own arguments, passed through
        self._header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        self._armed_at: int | None = None  # requests parsed when the deadline was set (None: no deadline)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        idle = not self._request_in_progress and not self._messages
        # The first bytes of a request after the last one's headers: its own deadline.
        if data and idle and self._armed_at != self._request_count:
            self._arm_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):  # the parser refused the request: 400, nothing failed here
            log.info("refused a malformed request (%s %s)", exc.code, exc.message)
            return
        super().log_exception(*args, **kw)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._armed_at = self._request_count
        self._header_deadline = self._loop.call_later(self._header_timeout, self._headers_due)

    def _headers_due(self) -> None:
        overdue = self._request_count == self._armed_at and not self._request_in_progress
        self._header_deadline, self._armed_at = None, None
        if overdue:
            log.info("closing a connection whose request headers took over %g s", self._header_timeout)
            self.force_close()


class CappedSite(web.TCPSite):
    """`web.TCPSite` whose protocol factory refuses connections beyond `max_connections` and gives
    each connection's requests `header_timeout` seconds for their headers (`ConnectionHandler`)."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int, header_timeout: float
    ) -> None:
        super().__init__(runner, host, port, backlog=LISTEN_BACKLOG)
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.refused = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None

        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) >= self.max_connections:
                self.refused += 1
                return _Busy()
            # as `server()` builds aiohttp's handler, from the runner's settings (`_kwargs`)
            return ConnectionHandler(server, loop=loop, header_timeout=self.header_timeout, **server._kwargs)

        self._server = await loop.create_server(
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
