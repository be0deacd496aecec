"""`batchserve serve`: start the five processes, wait until each is ready, supervise, drain on signal.

Each child runs `batchserve proc NAME --config runtime_dir/config.json` in its own process group,
with `PR_SET_PDEATHSIG` so that it dies with us, and reports readiness through its own
`$NOTIFY_SOCKET` (the sd_notify protocol, as under systemd).

SIGINT/SIGTERM: the api is stopped first (it answers 503 to new requests and lets running ones
finish for up to `drain_timeout_s`), then the rest. A second signal stops everything at once.
If any process dies on its own, the others are stopped and `serve` exits 1 naming it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from procs.launch import START_ORDER
from procs.runtime import configured_runtime_dir, make_private_dir
from shared.config import ServerConfig, add_config_arguments, config_from_args
from shared.shm import remove_segments_of

BACKEND_STOP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def _say(message: str) -> None:
    print(f"batchserve serve: {message}", file=sys.stderr, flush=True)


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: own process group, die with the parent."""
    os.setpgid(0, 0)
    libc_name = ctypes.util.find_library("c")
    if libc_name and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(libc_name, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    notify: socket.socket
    ready: bool = False
    expected_exit: bool = False
    killed_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)  # the whole group: helpers the process spawned too
        except (ProcessLookupError, PermissionError):
            pass


class Supervisor:
    def __init__(self, config: ServerConfig, runtime_dir: Path, *, owns_runtime_dir: bool) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.owns_runtime_dir = owns_runtime_dir
        self.children: dict[str, Child] = {}
        self.signals = 0

    # -- signals ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1

    # -- start --------------------------------------------------------------------------------
    def _spawn(self, name: str, config_path: Path) -> Child:
        notify_path = self.runtime_dir / f"notify-{name}.sock"
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(str(notify_path))
        env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), PYTHONUNBUFFERED="1")
        parent = os.getpid()
        popen = subprocess.Popen(
            [sys.executable, "-m", "procs.cli", "proc", name, "--config", str(config_path)],
            env=env, preexec_fn=lambda: _child_setup(parent), close_fds=True,
        )
        return Child(name, popen, notify)

    def _read_notifications(self, timeout_s: float) -> None:
        socks = {c.notify.fileno(): c for c in self.children.values()}
        try:
            readable, _, _ = select.select(list(socks), [], [], timeout_s)
        except InterruptedError:
            return
        for fd in readable:
            child = socks[fd]
            try:
                data = child.notify.recv(4096).decode(errors="replace")
            except OSError:
                continue
            if "READY=1" in data.split("\n"):
                child.ready = True

    def _dead_child(self) -> Child | None:
        for child in self.children.values():
            if child.popen.poll() is not None and not child.expected_exit:
                return child
        return None

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> int:
        config_path = self.runtime_dir / "config.json"
        config_path.write_bytes(msgspec.json.format(self.config.to_json()))
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            for name in START_ORDER:
                self.children[name] = self._spawn(name, config_path)
            return self._supervise()
        finally:
            self._stop_all()
            self._cleanup()

    def _supervise(self) -> int:
        started = time.monotonic()
        announced = False
        while True:
            self._read_notifications(0.2)
            if self._report_dead("; stopping the others"):
                return 1
            if self.signals:
                if not announced:
                    _say("stopping before every process was ready")
                    return 0
                return self._drain()
            if not announced and all(c.ready for c in self.children.values()):
                announced = True
                pids = " ".join(f"{c.name}={c.pid}" for c in self.children.values())
                print(f"batchserve: serving {self.config.served_model_name or self.config.model} at "
                      f"http://{self.config.host}:{self.config.port} (ready in "
                      f"{time.monotonic() - started:.1f}s; {pids}; runtime dir {self.runtime_dir})", flush=True)

    def _report_dead(self, suffix: str) -> bool:
        """Name a child that exited unexpectedly, if any (True: one did)."""
        dead = self._dead_child()
        if dead is None:
            return False
        _say(f"the {dead.name} process (pid {dead.pid}) exited with status "
             f"{_describe_status(dead.popen.returncode)}{suffix}")
        return True

    def _drain(self) -> int:
        """Stop the api first (it drains), then the backend; a second signal cuts it short."""
        _say(f"draining (up to {self.config.drain_timeout_s:g}s); signal again to stop now")
        api = self.children["api"]
        api.expected_exit = True
        signals_seen = self.signals
        api.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_timeout_s + BACKEND_STOP_TIMEOUT_S
        while api.popen.poll() is None and time.monotonic() < deadline and self.signals == signals_seen:
            self._read_notifications(0.2)
            if self._report_dead(" while draining"):
                return 1
        if api.popen.poll() is None:
            _say("the api did not finish draining in time; stopping it")
        return 0

    # -- stop ---------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        """SIGTERM every live process (the api first), wait, then SIGKILL their groups."""
        for name in ("api", *START_ORDER[:-1]):
            child = self.children.get(name)
            if child is not None:
                child.expected_exit = True
                if child.popen.poll() is None:
                    child.signal(signal.SIGTERM)
                    child.signal(signal.SIGCONT)  # a stopped (SIGSTOP) process takes SIGTERM only once running
        deadline = time.monotonic() + BACKEND_STOP_TIMEOUT_S
        for child in self.children.values():
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"the {child.name} process (pid {child.pid}) did not stop; killing it")
            child.signal(signal.SIGKILL)  # also reaps helpers left in its group
            if child.popen.poll() is None:
                child.popen.wait()

    def _cleanup(self) -> None:
        for child in self.children.values():
            child.notify.close()
            remove_segments_of(child.pid)  # what a killed process could not unlink itself
        if self.owns_runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        else:
            for child in self.children.values():
                (self.runtime_dir / f"notify-{child.name}.sock").unlink(missing_ok=True)


def _describe_status(code: int | None) -> str:
    if code is None:
        return "(running)"
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def main(args: argparse.Namespace) -> int:
    from procs.scheduler.config import check_config

    config = config_from_args(args)
    check_config(config)  # a bad policy/budget combination: one line now, not after loading the model
    chosen = configured_runtime_dir(config)
    if chosen:
        runtime_dir, owns = make_private_dir(Path(chosen)), False
    else:
        runtime_dir, owns = Path(tempfile.mkdtemp(prefix="batchserve-")), True
    config = msgspec.structs.replace(config, runtime_dir=str(runtime_dir))
    return Supervisor(config, runtime_dir, owns_runtime_dir=owns).run()
