"""The api's engine client when a backend process dies: requests in flight end at once with a 503,
/health gives the reason, new requests are refused, and serving resumes once every backend
process has been restarted. Driven over its real api socket with hand-made heartbeats."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import zmq

from batchserve.procs.api.engine_client_zmq import BACKEND_PROCESSES, ZmqEngineClient
from batchserve.shared.ipc import Endpoints, Sender
from batchserve.shared.messages import GenerateRequest, RequestRejected
from batchserve.shared.process_messages import BackendFailure, Heartbeat


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_dead_backend_fails_requests_in_flight_and_a_restart_clears_it(tmp_path):
    endpoints = Endpoints.in_dir(tmp_path)
    ctx = zmq.Context()
    to_api: Sender = Sender(ctx, endpoints.api)
    worker = _sleeper()
    pids = {name: os.getpid() for name in BACKEND_PROCESSES} | {"worker": worker.pid}

    def beat(pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            to_api.send(Heartbeat(process=name, pid=pid, ready=True, host=socket.gethostname()))

    async def wait_for(predicate, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    async def go():
        client = ZmqEngineClient(endpoints, "m", 64)
        await client.start()
        try:
            beat(pids)
            await wait_for(lambda: client.health_problem() is None)
            events = client.generate(GenerateRequest(rid="r1", prompt="hi"))
            pending = asyncio.ensure_future(events.__anext__())
            await asyncio.sleep(0.1)
            assert not pending.done()  # the tokenizer is not there: the request waits

            worker.kill()  # a zombie until reaped: still counts as gone
            killed_at = time.monotonic()
            event = await asyncio.wait_for(pending, 2)
            assert isinstance(event, RequestRejected) and event.status == 503
            assert f"worker process (pid {worker.pid}) exited" in event.message
            assert time.monotonic() - killed_at < 0.5
            assert "worker process" in client.health_problem()

            beat(pids)  # the dead pid again: still failed
            await asyncio.sleep(0.3)
            assert client.health_problem() is not None
            restarted = _sleeper()
            try:
                beat(pids | {"worker": restarted.pid})
                await wait_for(lambda: client.health_problem() is None)

                to_api.send(BackendFailure(process="worker", reason="no result for step 7"))
                await wait_for(lambda: client.health_problem() is not None)
                assert "stopped making progress: no result for step 7" in client.health_problem()
                beat(pids | {"worker": restarted.pid})  # only the scheduler restarted: not enough
                await asyncio.sleep(0.3)
                assert client.health_problem() is not None
            finally:
                restarted.kill()
                restarted.wait()
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        worker.wait()
        to_api.close()
        ctx.destroy(linger=0)


def test_a_backend_silent_for_seconds_fails_requests_and_serving_resumes_with_its_heartbeats(tmp_path):
    """A machine starved of CPU can stall a live process past the heartbeat limit (seen: a test server's
    worker at start, under load 5 on 2 cores): that fails the requests in flight, but once its heartbeats
    come back the server serves again; it does not answer 503 for ever."""
    endpoints = Endpoints.in_dir(tmp_path)
    ctx = zmq.Context()
    to_api: Sender = Sender(ctx, endpoints.api)
    pids = {name: os.getpid() for name in BACKEND_PROCESSES}

    def beat() -> None:
        for name, pid in pids.items():
            to_api.send(Heartbeat(process=name, pid=pid, ready=True, host=socket.gethostname()))

    async def go():
        client = ZmqEngineClient(endpoints, "m", 64)
        await client.start()
        try:
            beat()
            await asyncio.sleep(0.3)
            assert client.health_problem() is None
            events = client.generate(GenerateRequest(rid="r1", prompt="hi"))
            pending = asyncio.ensure_future(events.__anext__())
            event = await asyncio.wait_for(pending, 8)  # no heartbeat from anyone past the limit
            assert isinstance(event, RequestRejected) and "sent no heartbeat" in event.message
            assert client.health_problem() is not None
            deadline = time.monotonic() + 5
            while client.health_problem() is not None:
                assert time.monotonic() < deadline
                beat()
                await asyncio.sleep(0.2)
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        to_api.close()
        ctx.destroy(linger=0)
