"""The layout of the worker's tensor-parallel ranks, as every process sees it (no torch here: the api,
`serve` and the CLI check and name ranks without loading it). The ranks' collectives are
`procs.worker.parallel`'s.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import msgspec

from shared.config import ServerConfig

STANDALONE_INIT_ADDR = "127.0.0.1:29500"  # where ranks started on their own meet by default (torch's MASTER_PORT)
# While idle, rank 0 broadcasts a tick this often (`procs.worker.rank_steps`): the followers' wait for the
# next step, bounded by step_timeout_s, then ends only when rank 0 is gone or hung.
TICK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RankLayout:
    """Where one worker rank stands: its global and local rank among how many."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def of(cls, config: ServerConfig, local_rank: int) -> RankLayout:
        check_parallel_config(config)
        local_world = config.tensor_parallel_size // config.nnodes
        if not 0 <= local_rank < local_world:
            raise ValueError(f"--local-rank {local_rank}: this machine runs worker ranks 0..{local_world - 1} "
                             f"(tensor_parallel_size {config.tensor_parallel_size} over {config.nnodes} nodes)")
        return cls(rank=config.node_rank * local_world + local_rank, world_size=config.tensor_parallel_size,
                   local_rank=local_rank, local_world_size=local_world)


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
    # A tick can be a poll late: twice the interval leaves an idle follower's wait room for one.
    if tp > 1 and config.step_timeout_s <= 2 * TICK_INTERVAL_S:
        raise ValueError(f"step_timeout_s must be > {2 * TICK_INTERVAL_S:g} with tensor_parallel_size > 1 (it "
                         f"bounds the other ranks' wait for rank 0's idle ticks, sent every {TICK_INTERVAL_S:g} s), "
                         f"got {config.step_timeout_s:g}")


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
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return msgspec.structs.replace(config, dist_init_addr=f"127.0.0.1:{port}")
