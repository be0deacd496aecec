"""The layout of the worker's tensor-parallel ranks and of the server's data-parallel replicas, as every
process sees it (no torch here: the api, `serve` and the CLI check and name ranks without loading it).
The ranks' collectives are `procs.worker.parallel`'s.

Replicas (`--data-parallel-size N`): N complete servers on one machine, replica I's processes told
apart by `data_parallel_rank` I: its api listens on `replica_port` (port + I, or port + 1 + I behind a
router, which takes `port`), its sockets are in `runtime_dir/replica-I`, its worker on the I-th device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from batchserve.shared.config import ServerConfig
from batchserve.shared.ports import free_port

STANDALONE_INIT_ADDR = "127.0.0.1:29500"  # where ranks started on their own meet by default (torch's MASTER_PORT)
# While idle, rank 0 broadcasts a tick this often (`procs.worker.rank_steps`): the followers' wait for the
# next step, bounded by step_timeout_s, then ends only when rank 0 is gone or hung.
TICK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RankLayout:
    """Where one worker rank stands: its global and local rank among how many, and its replica (of
    `replicas` on this machine, each with `local_world_size` ranks)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    replica: int = 0
    replicas: int = 1

    @classmethod
    def of(cls, config: ServerConfig, local_rank: int) -> RankLayout:
        check_parallel_config(config)
        local_world = config.tensor_parallel_size // config.nnodes
        if not 0 <= local_rank < local_world:
            raise ValueError(
                f"--local-rank {local_rank}: this machine runs worker ranks 0..{local_world - 1} "
                f"(tensor_parallel_size {config.tensor_parallel_size} over {config.nnodes} nodes)"
            )
        return cls(
            rank=config.node_rank * local_world + local_rank,
            world_size=config.tensor_parallel_size,
            local_rank=local_rank,
            local_world_size=local_world,
            replica=config.data_parallel_rank,
            replicas=config.data_parallel_size,
        )

    @property
    def picks_device(self) -> bool:
        """The layout places this rank (cuda:I, a share of the cores), rather than --device alone: it is one
        of several ranks, or of several replicas."""
        return self.world_size > 1 or self.replicas > 1

    @property
    def first_local_device(self) -> int:
        """Index of this replica's first rank among this machine's devices (offset from --device's)."""
        return self.replica * self.local_world_size

    @property
    def cpu_shares(self) -> int:
        """Processes that split this machine's cores between them: every local rank of every replica."""
        return self.local_world_size * self.replicas


def check_parallel_config(config: ServerConfig) -> None:
    """ValueError naming the setting for a layout that cannot be run (checked before anything starts)."""
    tp, nnodes = config.tensor_parallel_size, config.nnodes
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if nnodes < 1 or tp % nnodes:
        raise ValueError(f"nnodes must be >= 1 and divide tensor_parallel_size {tp}, got {nnodes}")
    if not 0 <= config.node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {config.node_rank}")
    if nnodes > 1 and not config.dist_init_addr:
        raise ValueError("dist_init_addr HOST:PORT is required with nnodes > 1 (where global rank 0 listens)")
    if config.dist_init_addr:
        split_init_addr(config.dist_init_addr)
    if config.dist_timeout_s <= 0:
        raise ValueError(f"dist_timeout_s must be > 0, got {config.dist_timeout_s}")
    if config.step_timeout_s <= 0:
        raise ValueError(f"step_timeout_s must be > 0, got {config.step_timeout_s}")
    check_replicas(config)
    # A tick can be a poll late: twice the interval leaves an idle follower's wait room for one.
    if tp > 1 and config.step_timeout_s <= 2 * TICK_INTERVAL_S:
        raise ValueError(
            f"step_timeout_s must be > {2 * TICK_INTERVAL_S:g} with tensor_parallel_size > 1 (it "
            f"bounds the other ranks' wait for rank 0's idle ticks, sent every {TICK_INTERVAL_S:g} s), "
            f"got {config.step_timeout_s:g}"
        )


def split_init_addr(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {address!r}")
    return host, int(port)


def worker_process_names(config: ServerConfig) -> tuple[str, ...]:
    """The names this machine's worker ranks heartbeat as, by global rank: `worker` for rank 0,
    `worker-RANK` for the others (on a machine of node_rank > 0 its first rank too)."""
    layout = RankLayout.of(config, 0)
    return tuple(worker_rank_name(layout.rank + i) for i in range(layout.local_world_size))


def worker_rank_name(rank: int) -> str:
    return "worker" if rank == 0 else f"worker-{rank}"


def with_init_addr(config: ServerConfig) -> ServerConfig:
    """`config` with a free loopback port as its dist_init_addr when its ranks all run on this machine
    and it names none (so that two servers on one machine do not meet at the same port)."""
    if config.tensor_parallel_size == 1 or config.nnodes > 1 or config.dist_init_addr:
        return config
    return msgspec.structs.replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")


def check_replicas(config: ServerConfig) -> None:
    """ValueError naming the setting for a replica layout that cannot be run."""
    size, rank = config.data_parallel_size, config.data_parallel_rank
    if size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size={size}), got {rank}")
    # One replica's ranks meet at dist_init_addr and take cuda:0..tp-1; replicas of several ranks each
    # would need their own meeting point and devices, which nothing here gives them (nor tests).
    if size > 1 and config.tensor_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size {size} with tensor_parallel_size {config.tensor_parallel_size} is "
            "not supported: run one `batchserve serve --tp N` per replica (--device, --port) and put "
            "a router in front of them"
        )
    if replicated(config) and config.port == 0:
        raise ValueError(
            "port 0 (any free port) cannot be used with data_parallel_size > 1 or a router: the "
            "replicas' ports follow from port"
        )
    highest = router_metrics_port(config) if config.router != "none" else replica_port(config, size - 1)
    if highest > 65535:
        raise ValueError(f"port {config.port}: the replicas' ports (and the router's metrics port) would pass 65535")


def replica_port(config: ServerConfig, rank: int | None = None) -> int:
    """The port replica `rank`'s api listens on (default: this process's replica): port + rank, or
    port + 1 + rank behind a router (which listens on port). 0 (any free port) stays 0."""
    if config.port == 0:
        return 0
    rank = config.data_parallel_rank if rank is None else rank
    return config.port + (config.router != "none") + rank


def router_metrics_port(config: ServerConfig) -> int:
    """Where the router serves its own Prometheus metrics: the port after the last replica's."""
    return replica_port(config, config.data_parallel_size - 1) + 1


def local_url(host: str, port: int) -> str:
    """The base URL a process on this machine reaches `host:port` at (loopback for every interface)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def replica_urls(config: ServerConfig) -> list[str]:
    """Every replica's base URL, as the router reaches it."""
    return [local_url(config.host, replica_port(config, rank)) for rank in range(config.data_parallel_size)]


def peer_replica_urls(replica_config: ServerConfig) -> list[str]:
    """Every other replica's base URL, from a replica api's config, whose `port` is its own (`replica_port`)."""
    own, rank = replica_config.port, replica_config.data_parallel_rank
    base = msgspec.structs.replace(replica_config, port=own - (replica_config.router != "none") - rank)
    return [url for i, url in enumerate(replica_urls(base)) if i != rank]


def replicated(config: ServerConfig) -> bool:
    """The server is run as replicas (several, or one behind a router): processes are then named and
    placed per replica (`replica_dir`, `batchserve-api@I.service`)."""
    return config.data_parallel_size > 1 or config.router != "none"


def replica_dir(runtime_dir: Path, config: ServerConfig) -> Path:
    """This replica's sockets: `runtime_dir` itself for a server of one replica without a router,
    else its own subdirectory, so that replicas' sockets never meet."""
    return runtime_dir / f"replica-{config.data_parallel_rank}" if replicated(config) else runtime_dir
