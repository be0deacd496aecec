"""The gateway alone: `batchserve router` (a real smg) in front of two replica URLs, replica 0 an
in-process api (the api's own app and key checks over a FakeEngine), replica 1 a port where nothing
ever answers. The router reports ready (sd_notify READY=1) with the replica that serves and names the
other, rather than waiting for it. Keys: every client key serves `/v1/*` through the gateway but is
refused on smg's control plane (`/workers`: listing, adding or removing a worker), as a request without
a key is; only the router's internal key opens it, and that is the key smg shows the replica, never a
client's. Skipped where smg is not installed (the router extra)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from api_fake_engine import FakeEngine

from batchserve.loadtests.server_process import REPO, free_port
from batchserve.procs.api.app import create_app
from batchserve.procs.api.auth import INTERNAL_KEY_ENV
from batchserve.procs.router import REST_WAIT_S, healthy_workers
from batchserve.shared.commands import cli_command
from batchserve.shared.config import ServerConfig
from batchserve.shared.parallel import replica_port, replica_urls

pytest.importorskip("smg", reason="smg is not installed: `pip install -e '.[router]'` installs the gateway")

KEYS = ("k1", "k2")
INTERNAL = "internal-key-of-this-test"
READY_WITHIN_S = 60.0  # smg's start, replica 0's registration (a second or two), then REST_WAIT_S


class Replica:
    """A replica's api (`create_app` over a FakeEngine, its keys and the internal key) on a loop of its own
    thread, at the replica's port; `seen` is each request's (path, Authorization) as it arrived."""

    def __init__(self, config: ServerConfig) -> None:
        self.seen: list[tuple[str, str]] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="replica", daemon=True).start()
        self.runner = self._call(self._start(config))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self, config: ServerConfig) -> web.AppRunner:
        app = create_app(FakeEngine(), config)

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.path, request.headers.get("Authorization", "")))
            return await handler(request)

        app.middlewares.insert(0, record)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", replica_port(config)).start()
        return runner

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)


class Gateway:
    """`batchserve router` as a subprocess, its readiness read from its $NOTIFY_SOCKET as systemd would."""

    def __init__(self, config: ServerConfig, run_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{config.port}"
        self.log_path = run_dir / "router.log"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(run_dir / "notify.sock"))
        command = [
            *cli_command("router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(config.port),
            "--dp",
            str(config.data_parallel_size),
            "--router",
            "smg",
            *(f"--api-key={key}" for key in KEYS),
        ]
        env = {
            **os.environ,
            INTERNAL_KEY_ENV: INTERNAL,
            "NOTIFY_SOCKET": str(run_dir / "notify.sock"),
            "PYTHONUNBUFFERED": "1",
        }
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.started = time.monotonic()

    def wait_ready(self, timeout_s: float) -> float | None:
        """Seconds from the start to READY=1; None if it did not come within `timeout_s`."""
        self.notify.settimeout(0.5)
        while time.monotonic() - self.started < timeout_s and self.proc.poll() is None:
            try:
                message = self.notify.recv(4096).decode()
            except TimeoutError:
                continue
            if "READY=1" in message.split("\n"):
                return time.monotonic() - self.started
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.notify.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Replica, ServerConfig, float | None]]:
    config = ServerConfig(
        host="127.0.0.1", port=free_port(span=4), data_parallel_size=2, router="smg", api_key=list(KEYS)
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv(INTERNAL_KEY_ENV, INTERNAL)  # as `serve` and the units give it to the replicas' apis
        replica = Replica(config)  # replica 0; nothing listens at replica 1's port
    gateway = Gateway(config, tmp_path_factory.mktemp("gateway"))
    try:
        yield gateway, replica, config, gateway.wait_ready(READY_WITHIN_S)
        assert gateway.stop() == 0, gateway.log()
    finally:
        if gateway.proc.poll() is None:
            gateway.proc.kill()
        replica.close()


def call(url: str, method: str = "GET", key: str | None = None, body: dict | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        url, method=method, headers=headers, data=json.dumps(body).encode() if body is not None else None
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def chat(url: str, key: str | None) -> tuple[int, Any]:
    return call(
        f"{url}/v1/chat/completions",
        "POST",
        key,
        {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )


def test_the_router_is_ready_with_one_replica_while_the_other_never_answers(setup):
    gateway, _, config, ready_after = setup
    serving, absent = replica_urls(config)
    assert ready_after is not None, gateway.log()
    assert ready_after >= REST_WAIT_S  # it gave the other replica its while
    assert f"routes to {serving}; not yet healthy: {absent}" in gateway.log()
    assert healthy_workers(gateway.url, INTERNAL) == {serving}
    status, answer = chat(gateway.url, KEYS[0])
    assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello, world!", answer


def test_client_keys_serve_but_never_open_smgs_control_plane(setup):
    gateway, replica, config, _ = setup
    serving = replica_urls(config)[0]
    for key in KEYS:
        assert chat(gateway.url, key)[0] == 200, key
    assert chat(gateway.url, None)[0] == 401 and chat(gateway.url, "not-a-key")[0] == 401
    status, listing = call(f"{gateway.url}/workers", key=INTERNAL)  # the control plane, with its own key
    assert status == 200, listing
    [worker] = [w for w in listing["workers"] if w["url"] == serving]
    intruder = {"url": f"http://127.0.0.1:{free_port()}"}
    for key in (*KEYS, None):  # the first client key is no admin key any more
        assert call(f"{gateway.url}/workers", key=key)[0] == 401, key
        assert call(f"{gateway.url}/workers", "POST", key, intruder)[0] == 401, key
        assert call(f"{gateway.url}/workers/{worker['id']}", "DELETE", key)[0] == 401, key
    time.sleep(1)  # what a refused request would have set off
    assert intruder["url"] not in {w["url"] for w in call(f"{gateway.url}/workers", key=INTERNAL)[1]["workers"]}
    assert healthy_workers(gateway.url, INTERNAL) == {serving}
    assert chat(gateway.url, KEYS[1])[0] == 200
    # smg shows the replica its internal key (registration), and passes a client's own key through
    shown = {auth for path, auth in replica.seen if path != "/v1/chat/completions" and auth}
    assert shown == {f"Bearer {INTERNAL}"}, replica.seen
    assert {auth for path, auth in replica.seen if path == "/v1/chat/completions"} == {f"Bearer {k}" for k in KEYS}
