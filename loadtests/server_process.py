"""Start a server as a subprocess on a free port, wait for `/health`, and stop it (all its processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

DEFAULT_SERVE_COMMAND: tuple[str, ...] = (sys.executable, "-m", "procs.cli", "serve")


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`command` plus `--host 127.0.0.1 --port P`, in its own process group, its output in `log_path`."""

    def __init__(self, command: Sequence[str], log_path: Path, health_timeout_s: float = 600.0,
                 stop_timeout_s: float = 30.0, env: Mapping[str, str] | None = None):
        self.port = free_port()
        self.command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self.health_timeout_s, self.stop_timeout_s = health_timeout_s, stop_timeout_s
        self.env = None if env is None else {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # a new session: the server's child processes share its group, so stop() reaches them all
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with status {self.proc.returncode} before it was healthy: "
                                       f"{' '.join(self.command)}\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"server not healthy after {self.health_timeout_s:.0f}s: "
                               f"{' '.join(self.command)}\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM (graceful drain), then SIGKILL for whatever of its process group is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the server's pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone
        self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
