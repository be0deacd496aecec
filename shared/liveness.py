"""Whether a process still runs on this host (used where a dead peer cannot say so itself)."""

from __future__ import annotations

import os


def pid_gone(pid: int) -> bool:
    """True if no process `pid` runs here, or it is a zombie (dead, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
