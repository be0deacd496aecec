"""What every batchserve process shares: its configuration, sockets' addresses, the stop signal,
readiness and heartbeats. `procs.launch` builds one `ProcessRuntime` per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from batchserve.shared.config import ServerConfig
from batchserve.shared.ipc import Endpoints, Sender
from batchserve.shared.parallel import replica_dir
from batchserve.shared.process_messages import Heartbeat
from batchserve.shared.readiness import notify_ready, notify_stopping, notify_watchdog, watchdog_enabled
from batchserve.shared.shm import remove_stale_segments

HEARTBEAT_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.1  # how often blocking loops look at the stop flag
WATCHDOG_INTERVAL_S = 1.0  # WATCHDOG=1 at most this often (WatchdogSec= is far longer)
PR_SET_PDEATHSIG = 1

log = logging.getLogger("batchserve.process")


def default_runtime_dir() -> Path:
    """Where standalone processes meet when neither the config nor systemd names a directory."""
    return Path(tempfile.gettempdir()) / f"batchserve-{os.getuid()}"


def resolve_runtime_dir(config: ServerConfig) -> Path:
    """`config.runtime_dir`, else systemd's `$RUNTIME_DIRECTORY`, else `default_runtime_dir()`, or in it
    this process's replica's directory (`shared.parallel.replica_dir`); created if missing, and made
    private (0700) even if it existed: it holds every socket."""
    chosen = configured_runtime_dir(config)
    base = make_private_dir(Path(chosen) if chosen else default_runtime_dir())
    return make_private_dir(replica_dir(base, config))


def configured_runtime_dir(config: ServerConfig) -> str:
    """`config.runtime_dir`, else systemd's `$RUNTIME_DIRECTORY` (its first entry); "" for neither."""
    return config.runtime_dir or os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]


def make_private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except PermissionError:
        raise ValueError(f"runtime dir {path}: not ours, so it cannot be made private (0700)") from None
    return path


def die_with_parent(parent_pid: int) -> None:
    """Run in a child between fork and exec: SIGTERM it when its parent dies (Linux), so that no
    process outlives the one that supervises it; exit at once if the parent is gone already."""
    libc_name = ctypes.util.find_library("c")
    if libc_name and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(libc_name, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class StopRequested(BaseException):
    """Raised by SIGTERM/SIGINT in a process that is not ready yet: nothing runs that needs a clean
    finish, so the stop need not wait for a model load (a minute for a large one). A BaseException,
    so that the loaders' `except Exception` does not take it for a load failure; `procs.launch`
    ends the process with status 0 on it."""


class ProcessRuntime:
    """One process's shared plumbing: zmq context, endpoints, SIGTERM/SIGINT -> `stopping`.

    A process runs inside `with ProcessRuntime(name, config) as rt:`, which handles the stop signals and
    beats the heartbeat from the start, and closes it all (sockets, heartbeat, `notify_stopping`) at the end.
    """

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.runtime_dir = resolve_runtime_dir(config)
        stale = remove_stale_segments()
        if stale:
            log.info("removed shared memory left by stopped processes", extra={"fields": {"segments": stale}})
        self.endpoints = Endpoints.in_dir(self.runtime_dir)
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self.signalled = False  # asked to stop (SIGTERM/SIGINT), rather than ending on our own
        self._ready = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._watchdog = watchdog_enabled()
        self._last_watchdog = 0.0

    def __enter__(self) -> ProcessRuntime:
        self.install_signal_handlers()
        self.start_heartbeat()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT ask the main loop to finish (it looks at `stopping` between steps);
        before `ready()` they end the start at once (`StopRequested`)."""

        def handle(signum: int, frame: object) -> None:
            first = not self.stopping.is_set()
            if not first and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signalled = True
            self.stopping.set()
            if first and not self._ready.is_set():  # once: a second signal must not cut the cleanup short
                raise StopRequested(signal.Signals(signum).name)

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
                sender.send(
                    Heartbeat(process=self.name, pid=os.getpid(), ready=self._ready.is_set(), host=socket.gethostname())
                )
                self.stopping.wait(HEARTBEAT_INTERVAL_S)
        finally:
            sender.close()

    def ready(self) -> None:
        """This process can serve: systemd / `batchserve serve` learn it through $NOTIFY_SOCKET."""
        self._ready.set()
        log.info("%s ready", self.name, extra={"fields": {"pid": os.getpid()}})
        notify_ready()  # after the line: `serve`'s ready line then follows every process's

    def alive(self) -> None:
        """Called by the main loop whenever it makes progress or idles: systemd's watchdog
        (`WatchdogSec=`) restarts a unit whose main loop stops calling this."""
        if not self._watchdog:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= WATCHDOG_INTERVAL_S:
            self._last_watchdog = now
            notify_watchdog()

    def close(self) -> None:
        self.stopping.set()
        notify_stopping()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2)
        # Ending on our own (a failure to report): flush what is queued for at most a second. Asked to
        # stop: the peers are stopping too (the api first), so what is still queued has no reader and
        # waiting for it only delays the exit.
        self.ctx.destroy(linger=0 if self.signalled else 1000)
