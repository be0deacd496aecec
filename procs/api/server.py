"""Run the api's HTTP application: `await start_api(engine, config)` on a running loop (the api
process's, on uvloop: `procs.api.process`).

It listens through `CappedSite` (a cap on open connections, answered 503; `header_timeout_s` for
each request's headers), keeps idle connections `keep_alive_timeout_s` (and says so in a
`Keep-Alive` header) and raises the open-file limit first. The engine client's optional
`start()`/`close()` run inside the loop (see `engine_client.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from batchserve.procs.api.app import create_app
from batchserve.procs.api.connections import CappedSite, raise_open_file_limit
from batchserve.procs.api.engine_client import EngineClient
from batchserve.shared.chat_format import ReasoningFormat
from batchserve.shared.config import ServerConfig
from batchserve.shared.pooling import PoolerConfig

logger = logging.getLogger("batchserve.api")


async def start_api(
    engine: EngineClient, config: ServerConfig, *, reasoning: ReasoningFormat = "", pooler: PoolerConfig | None = None
) -> web.AppRunner:
    """Start the app on the running loop; `await runner.cleanup()` stops it (waiting up to
    `config.drain_timeout_s` for open requests). `reasoning`, `pooler`: as `create_app`'s."""
    max_connections = raise_open_file_limit(config.max_connections)
    runner = web.AppRunner(
        create_app(engine, config, reasoning=reasoning, pooler=pooler),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.drain_timeout_s,
        keepalive_timeout=config.keep_alive_timeout_s,
    )
    runner.app.on_response_prepare.append(_keep_alive_header(config.keep_alive_timeout_s))
    await runner.setup()
    site = CappedSite(
        runner, config.host, config.port, max_connections=max_connections, header_timeout=config.header_timeout_s
    )
    await site.start()
    # Not at info: the api listens (answering 503) long before it is ready, which its process says.
    logger.debug("api listening on http://%s:%d (model %s)", config.host, config.port, engine.model_name)
    return runner


def _keep_alive_header(timeout_s: float) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """`Keep-Alive: timeout=N` on responses that keep their connection, so that a client's pool (or a
    proxy) drops an idle connection before the server does instead of sending into a closed one."""
    value = f"timeout={int(timeout_s)}"

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        if request.keep_alive and response.keep_alive is not False:
            response.headers["Keep-Alive"] = value

    return add
