"""The api process: the HTTP app (`procs.api.app`) on a `ZmqEngineClient`, with drain on SIGTERM.

Ready (sd_notify) once it listens and every backend process has reported ready. On SIGTERM/SIGINT
it drains: new requests get 503 (the engine client reports unhealthy), requests already running
may finish for up to `drain_timeout_s`; whatever is still running then ends with an error event
(finish_reason "abort"), and the server closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import msgspec
import uvloop

from batchserve.procs.api.app import HANDLERS_KEY, ApiHandlers
from batchserve.procs.api.engine_client_zmq import ZmqEngineClient, backend_processes
from batchserve.procs.api.server import start_api
from batchserve.procs.runtime import resolve_runtime_dir
from batchserve.shared.checks import max_prompt_chars, model_token_chars
from batchserve.shared.config import ServerConfig
from batchserve.shared.ipc import Endpoints
from batchserve.shared.model import ModelSpec, read_model_json
from batchserve.shared.parallel import replica_port
from batchserve.shared.pooling import pooler_for
from batchserve.shared.readiness import notify_ready, notify_stopping

log = logging.getLogger("batchserve.api")
DRAIN_POLL_S = 0.05
AIOHTTP_SHUTDOWN_S = 1.0
CUT_OFF_S = 1.0


async def serve(config: ServerConfig) -> int:
    spec = ModelSpec.from_config(config)
    # A model that thinks in <think> blocks (Qwen3, DeepSeek-R1): chat answers split them out.
    reasoning = spec.chat_format.reasoning
    engine = ZmqEngineClient(
        Endpoints.in_dir(resolve_runtime_dir(config)),
        config.served_model_name or config.model,
        spec.context_length,
        backend_processes(config),
        max_prompt_chars=max_prompt_chars(spec.context_length, model_token_chars(spec.model_dir)),
        vocab_size=model_vocab_size(spec),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # The drain below is ours; aiohttp's own shutdown wait only has to cut off what outlived it. A replica
    # listens on its own port (shared.parallel.replica_port).
    port = replica_port(config)
    try:
        runner = await start_api(
            engine,
            msgspec.structs.replace(config, drain_timeout_s=AIOHTTP_SHUTDOWN_S, port=port),
            reasoning=reasoning,
            pooler=pooler_for(
                spec.model_dir, spec.architecture, read_model_json(spec.model_dir), config.runner, config.pooling
            ),
        )
    except OSError as exc:  # port in use, address not available: a configuration error
        raise ValueError(f"cannot listen on {config.host}:{port}: {exc.strerror or exc}") from None
    try:
        await _wait_for_backends(engine, stop, f"http://{config.host}:{port}")
        await stop.wait()
        notify_stopping()
        await _drain(engine, runner.app[HANDLERS_KEY], config.drain_timeout_s)
    finally:
        await runner.cleanup()
    return 0


def model_vocab_size(spec: ModelSpec) -> int | None:
    """How many token ids are surely the tokenizer's (tokenizer.json's own vocabulary: the tokenizer process
    adds any added tokens besides) and the model's (config.json's logits width); None without a tokenizer.json.
    The OpenAPI document's bound on token ids: this process does not load the tokenizer."""
    path = spec.model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    vocab = (json.loads(path.read_text()).get("model") or {}).get("vocab") or ()
    return min(len(vocab), spec.vocab_size or len(vocab)) or None


async def _wait_for_backends(engine: ZmqEngineClient, stop: asyncio.Event, url: str) -> None:
    """Wait until every backend process has reported ready, then report the api ready (its log line,
    sd_notify), unless a stop signal comes first."""
    while not engine.backends_ready() and not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:  # not the builtin TimeoutError before Python 3.11
            pass
    if not stop.is_set():
        log.info("api ready", extra={"fields": {"pid": os.getpid(), "url": url, "model": engine.model_name}})
        notify_ready()


async def _drain(engine: ZmqEngineClient, handlers: ApiHandlers, drain_timeout_s: float) -> None:
    """Refuse new requests, let those in flight finish for up to `drain_timeout_s`, then end whatever
    still runs with an error event (and give its handler a moment to write it)."""
    engine.draining = True  # new requests and /health now answer 503
    started = time.monotonic()
    log.info("draining %d requests (up to %gs)", handlers.in_flight, drain_timeout_s)
    while handlers.in_flight > 0 and time.monotonic() < started + drain_timeout_s:
        await asyncio.sleep(DRAIN_POLL_S)
    cut_off = handlers.in_flight
    if cut_off:
        log.warning("drain timeout: %d requests still running are cut off", cut_off)
        engine.fail_all(
            f"the server is shutting down: the request did not finish within the drain timeout of {drain_timeout_s:g} s"
        )
        deadline = time.monotonic() + CUT_OFF_S  # time for their handlers to write the last event
        while handlers.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
    log.info("drained", extra={"fields": {"cut_off": cut_off, "seconds": round(time.monotonic() - started, 2)}})


def run(config: ServerConfig) -> int:
    return uvloop.run(serve(config))
