"""What `batchserve serve` starts on this machine (`launches`: its children, in start order, each a
`Launch`), and the ports its server will listen on, checked free before any process starts.

One server is the five processes, its worker one child per local tensor-parallel rank; a machine of
node_rank > 0 runs only its worker ranks; replicas (`--data-parallel-size N`, or a `--router`) are N
copies of the five, replica I's children started with `--data-parallel-rank I`, and the router after
every replica is ready (`ROUTER`). The supervision of what started is `procs.serve`.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

from batchserve.procs.launch import START_ORDER
from batchserve.shared.config import ServerConfig
from batchserve.shared.parallel import replica_port, replicated, router_metrics_port, worker_process_names


@dataclass(frozen=True)
class Launch:
    """One child to start: its name (as it heartbeats), the process it runs, its worker rank, and the
    replica it belongs to (None: the server is not run as replicas, or the router)."""

    name: str
    process: str
    local_rank: int = 0
    replica: int | None = None

    @property
    def key(self) -> str:
        """How `serve` names it (ready line, exits): its name, `@I` added for replica I's."""
        return self.name if self.replica is None else f"{self.name}@{self.replica}"


ROUTER = Launch("router", "router")  # started once every replica is ready, as its systemd unit is


def launches(config: ServerConfig) -> list[Launch]:
    """This machine's children in start order: every worker rank where the worker starts; on a
    machine of node_rank > 0 only its worker ranks (the api and the rest run on node 0); with
    replicas, the five processes of each, replica by replica (the router comes after them)."""
    ranks = [Launch(name, "worker", i) for i, name in enumerate(worker_process_names(config))]
    if config.node_rank > 0:
        return ranks
    server = [
        launch for process in START_ORDER for launch in (ranks if process == "worker" else [Launch(process, process)])
    ]
    if not replicated(config):
        return server
    return [dataclasses.replace(launch, replica=i) for i in range(config.data_parallel_size) for launch in server]


def listen_ports(config: ServerConfig) -> list[int]:
    """The ports this machine's server listens on: each replica's api, and the router's two."""
    if config.node_rank > 0:
        return []
    ports = [replica_port(config, i) for i in range(config.data_parallel_size)]
    return ports + [config.port, router_metrics_port(config)] if config.router != "none" else ports


def check_can_listen(host: str, port: int) -> None:
    """Raise ValueError (one line from the CLI, exit status 2) if the api could not listen on
    `host:port`, found before any process starts rather than by the api while the others load. The
    bind is the api's own (asyncio's: every address of `host`, SO_REUSEADDR, IPv6 only on IPv6); a
    port taken in between is still the api's error, and `serve` then stops the others."""
    if port == 0:  # any free port: nothing can be taken
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
