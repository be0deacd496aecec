"""What every batchserve process shares: its configuration, sockets' addresses, the stop signal,
readiness and heartbeats. `procs.launch` builds one `ProcessRuntime` per process.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from pathlib import Path

import zmq

from shared.config import ServerConfig
from shared.ipc import Endpoints, Sender
from shared.messages import Heartbeat
from shared.readiness import notify_ready, notify_stopping

HEARTBEAT_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.1  # how often blocking loops look at the stop flag

log = logging.getLogger("batchserve.process")


def default_runtime_dir() -> Path:
    """Where standalone processes meet when neither the config nor systemd names a directory."""
    return Path(tempfile.gettempdir()) / f"batchserve-{os.getuid()}"


def resolve_runtime_dir(config: ServerConfig) -> Path:
    """`config.runtime_dir`, else systemd's `$RUNTIME_DIRECTORY`, else `default_runtime_dir()`."""
    chosen = config.runtime_dir or os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    path = Path(chosen) if chosen else default_runtime_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


class ProcessRuntime:
    """One process's shared plumbing: zmq context, endpoints, SIGTERM/SIGINT -> `stopping`."""

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.runtime_dir = resolve_runtime_dir(config)
        self.endpoints = Endpoints.in_dir(self.runtime_dir)
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self._ready = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT ask the main loop to finish (it looks at `stopping` between steps)."""

        def handle(signum: int, frame: object) -> None:
            if self.stopping.is_set() and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stopping.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def start_heartbeat(self) -> None:
        """Tell the api every second that this process is alive (and whether it is ready yet)."""
        self._heartbeat = threading.Thread(target=self._beat, name=f"{self.name}-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        sender: Sender[Heartbeat] = Sender(self.ctx, self.endpoints.api)
        sender.socket.setsockopt(zmq.LINGER, 0)
        try:
            while not self.stopping.is_set():
                sender.send(Heartbeat(process=self.name, pid=os.getpid(), ready=self._ready.is_set()))
                self.stopping.wait(HEARTBEAT_INTERVAL_S)
        finally:
            sender.close()

    def ready(self) -> None:
        """This process can serve: systemd / `batchserve serve` learn it through $NOTIFY_SOCKET."""
        self._ready.set()
        notify_ready()
        log.info("%s ready", self.name, extra={"fields": {"pid": os.getpid()}})

    def close(self) -> None:
        self.stopping.set()
        notify_stopping()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2)
        self.ctx.destroy(linger=1000)  # flushes queued messages for at most a second
