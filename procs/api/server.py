"""Run the api's HTTP application with uvloop: `run_api(engine, config)`.

Blocks until SIGINT/SIGTERM, then stops accepting connections and gives open requests up to
`config.drain_timeout_s` to finish (aiohttp's graceful shutdown). The engine client's optional
`start()`/`close()` run inside this loop (see `engine_client.py`).
"""

from __future__ import annotations

import logging

import uvloop
from aiohttp import web

from procs.api.app import create_app
from procs.api.engine_client import EngineClient
from shared.config import ServerConfig

logger = logging.getLogger("batchserve.api")


def run_api(engine: EngineClient, config: ServerConfig) -> None:
    """Serve `engine` on `config.host:config.port` until a termination signal."""
    app = create_app(engine, config)
    logger.info("api listening on http://%s:%d (model %s)", config.host, config.port, engine.model_name)
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        loop=uvloop.new_event_loop(),
        handler_cancellation=True,  # a client that disconnects cancels its handler -> engine.abort
        shutdown_timeout=config.drain_timeout_s,
        access_log=None,  # the request log (logger batchserve.requests) replaces aiohttp's access log
        print=None,
    )


async def start_api(engine: EngineClient, config: ServerConfig) -> web.AppRunner:
    """Start the app on the running loop (for callers that own their loop); `await runner.cleanup()` stops it."""
    runner = web.AppRunner(create_app(engine, config), handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.drain_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    return runner


