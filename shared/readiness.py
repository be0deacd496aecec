"""Readiness and status notifications: the sd_notify protocol, with no dependency.

`notify_ready()` is called by every process once it can serve. Under systemd (`Type=notify`) it
tells the service manager the unit is up; under `batchserve serve` the supervisor listens on the
same kind of socket, so one mechanism covers both. Without `$NOTIFY_SOCKET` it does nothing.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1", "STOPPING=1", "STATUS=...") to `$NOTIFY_SOCKET`; False if unset."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace: a leading NUL byte instead of '@'
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def notify_ready() -> bool:
    """This process can serve (the one place a process declares itself ready)."""
    return notify(f"READY=1\nMAINPID={os.getpid()}")


def notify_stopping() -> bool:
    return notify("STOPPING=1")


def watchdog_enabled() -> bool:
    """systemd set `WatchdogSec=` for this process (`$WATCHDOG_USEC`, for our pid if it names one)."""
    if not os.environ.get("WATCHDOG_USEC"):
        return False
    pid = os.environ.get("WATCHDOG_PID")
    return pid is None or pid == str(os.getpid())


def notify_watchdog() -> bool:
    """The main loop is making progress (systemd restarts the unit if this stops for WatchdogSec=)."""
    return notify("WATCHDOG=1")
