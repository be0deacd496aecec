"""Start a server as a subprocess on a free port, wait until it is ready, and stop it (all its processes).

`batchserve bench --compare` starts its servers with it, and the end-to-end tests theirs
(`tests/e2e_server.py`, which waits for `batchserve serve`'s "serving" line instead of `/health`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from batchserve.shared.commands import cli_command
from batchserve.shared.ports import free_port

DEFAULT_SERVE_COMMAND: tuple[str, ...] = tuple(cli_command("serve"))
# The checkout: the working directory the tests' servers run in (any would do: they run with python -P).
REPO = Path(__file__).resolve().parent.parent


class ServerStartError(RuntimeError):
    pass


# Ports a started server may take from its own on: its replicas' and its router's (`--data-parallel-size`,
# `--router`: shared.parallel.replica_port), free when it starts.
SERVER_PORT_SPAN = 16
PROBE_TIMEOUT_S = 2.0  # for each readiness request


def _probe_failure(exc: BaseException) -> str:
    """What a failed readiness request met, in words."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:g} s (the port accepts connections; nothing answers)"
    return f"{type(reason).__name__}: {reason}"


class ServerProcess:
    """`command` plus `--host 127.0.0.1 --port P`, in its own process group, its output in `log_path`.

    Ready when `ready()` says so (by default: `/health` answers 200); a subclass may wait for
    something else."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        health_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ):
        self.port = free_port(SERVER_PORT_SPAN)
        self.command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self.health_timeout_s, self.stop_timeout_s = health_timeout_s, stop_timeout_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._group_killed = False
        # why the last readiness probe failed ("" while none has): said when the server is not ready in time,
        # since a refused connection (nothing listens yet), a 503 (still starting) and a read timeout
        # (something accepts the connection but answers nothing) are three different stories
        self.not_ready = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # a new session: the server's child processes share its group, so stop() reaches them all
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
                cwd=self.cwd,
            )
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # whatever it had started
                raise ServerStartError(
                    f"server exited with status {self.proc.returncode} before it was ready: "
                    f"{' '.join(self.command)}\n{self.log_tail()}"
                )
            if self.ready():
                return
            time.sleep(0.2)
        self.stop()
        last = f" (last readiness probe: {self.not_ready})" if self.not_ready else ""
        raise ServerStartError(
            f"server not ready after {self.health_timeout_s:.0f}s{last}: {' '.join(self.command)}\n{self.log_tail()}"
        )

    def ready(self) -> bool:
        return self.healthy() and self.serves_a_model()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=PROBE_TIMEOUT_S) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            self.not_ready = f"GET /health: {_probe_failure(exc)}"
            return False

    def serves_a_model(self) -> bool:
        """`/v1/models` lists one: a gateway answers /health before it has registered its workers."""
        try:
            with urllib.request.urlopen(self.base_url + "/v1/models", timeout=PROBE_TIMEOUT_S) as resp:
                if json.loads(resp.read()).get("data"):
                    return True
                self.not_ready = "GET /v1/models: no model listed yet"
                return False
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError, AttributeError) as exc:
            self.not_ready = f"GET /v1/models: {_probe_failure(exc)}"
            return False

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (graceful drain; up to `timeout`, default `stop_timeout_s`), then SIGKILL for whatever
        of its process group is left. Returns the server's exit status (None if it was never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                pass
        if not self._group_killed:
            self._group_killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: the group id is the server's pid
            except (ProcessLookupError, PermissionError):
                pass  # the group is already gone
        return self.proc.wait(timeout=10)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
