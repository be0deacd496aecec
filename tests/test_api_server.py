"""`start_api` in a real process on uvloop (as the api process runs it): engine start/close inside the
loop, and `runner.cleanup()` on SIGTERM shuts it down cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from batchserve.shared.ports import free_port

TESTS_DIR = Path(__file__).parent

SCRIPT = textwrap.dedent("""
    import asyncio, signal, sys
    import uvloop
    sys.path.insert(0, {tests!r})
    from api_fake_engine import FakeEngine
    from batchserve.procs.api.server import start_api
    from batchserve.shared.config import ServerConfig
    from batchserve.shared.logs import setup_logging

    class LifecycleEngine(FakeEngine):
        async def start(self):
            loop = type(asyncio.get_running_loop())
            print("started on", loop.__module__, flush=True)
        async def close(self):
            print("closed", flush=True)

    async def serve():
        runner = await start_api(LifecycleEngine(), ServerConfig(port={port}))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    setup_logging("json")
    uvloop.run(serve())
""")


def _get(url: str, data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, resp.read()


def test_start_api_serves_on_uvloop_and_stops_cleanly():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(tests=str(TESTS_DIR), port=port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                status, _ = _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "start_api did not come up"
                time.sleep(0.1)
        assert status == 200
        status, body = _get(f"http://127.0.0.1:{port}/v1/completions", json.dumps({"prompt": "hi"}).encode())
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "Hello, world!"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["started on uvloop", "closed"]
    log_lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    requests = [line for line in log_lines if line["logger"] == "batchserve.requests"]
    assert len(requests) == 1 and requests[0]["status"] == 200 and requests[0]["finish_reason"] == "stop"
    assert "Traceback" not in err
