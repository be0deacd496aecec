"""`ServerProcess` (what `batchserve bench --compare` starts its servers with): a server that is not ready
in time fails with why its last readiness probe failed, and is stopped."""

from __future__ import annotations

import sys
import time

import pytest

from batchserve.loadtests.server_process import ServerProcess, ServerStartError

# Listens on the --port it is given and never accepts: a connection is queued by the kernel, and a
# request on it gets no answer (what a stalled api looks like to the probe).
SILENT = """
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen(16)
print("listening", flush=True)
time.sleep(600)
"""
# Runs without listening at all.
DEAF = "import time; time.sleep(600)"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (SILENT, "GET /health: no answer within 2 s (the port accepts connections; nothing answers)"),
        (DEAF, "GET /health: ConnectionRefusedError"),
    ],
    ids=["silent", "not listening"],
)
def test_a_server_not_ready_in_time_says_what_its_probe_met_and_is_stopped(tmp_path, script, expected):
    server = ServerProcess([sys.executable, "-c", script], tmp_path / "server.log", health_timeout_s=3)
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="server not ready after 3s") as raised:
        server.start()
    assert time.monotonic() - started < 15
    assert f"(last readiness probe: {expected}" in str(raised.value)
    assert server.proc is not None and server.proc.poll() is not None  # stopped, not left behind
