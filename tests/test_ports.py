"""batchserve.shared.ports: a free port is drawn from below the ephemeral range, where connect() never lands."""

from __future__ import annotations

import socket

from batchserve.shared import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    start = ports._ephemeral_start()
    for span in (1, 8):
        port = ports.free_port(span)
        assert 10000 <= port and port + span <= start
        for p in range(port, port + span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_free():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        assert not ports.can_bind(taken.getsockname()[1])
