"""Free loopback ports for a listener that binds later (a server's port, a process group's rendezvous).

A port the kernel hands out for bind(("127.0.0.1", 0)) lies in the ephemeral range, the range it also
draws the source ports of outgoing connections from. Between the probe and the real bind any connect()
on the machine may take it (it happened: a TCPStore client took a test server's api port). So the
port is drawn at random from below that range, where only an explicit bind lands.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # clear of the well-known and the usual registered service ports


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; the IANA range starts higher still


def can_bind(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A free loopback port outside the ephemeral range; with `span` > 1, the first of that many
    consecutive free ports (a server's and its replicas' or router's)."""
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    top = _ephemeral_start() - span
    if top <= _LOWEST:
        raise RuntimeError(f"no room for {span} ports below the ephemeral range (starts at {top + span})")
    for _ in range(1000):
        port = random.randrange(_LOWEST, top)
        if all(can_bind(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} consecutive free loopback ports found below {top + span}")
