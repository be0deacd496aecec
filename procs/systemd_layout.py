"""The systemd units one machine runs, by its layout (`machine_units`): their names, and the values of the
unit templates' name placeholders (`@WORKERS@`, `@PART_OF@`, ...) that `install-systemd` fills in.

One server (`MachineUnits`): one instance of `batchserve-worker@.service` per local tensor-parallel rank,
plus scheduler, tokenizer, detokenizer and api on the machine of node_rank 0 only. Replicas
(`ReplicaUnits`: data_parallel_size > 1, or a router): the same five unit files installed as templates
(`batchserve-api@.service`, ...), instance I being replica I's process, grouped by `batchserve@I.target`,
and the router's unit. Writing them is `procs.install_systemd`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchserve.procs.launch import START_ORDER
from batchserve.shared.config import ServerConfig
from batchserve.shared.parallel import RankLayout, replica_port, replicated

ENV_DIR = Path("etc/batchserve")  # under the install's prefix: the units' EnvironmentFile= files
# With a router: its internal key, for the router's unit and the replicas' api units alone.
INTERNAL_KEY_FILE_NAME = "internal-key.env"

TARGET = "batchserve.target"
WORKER_TEMPLATE = "batchserve-worker@.service"  # one instance per local rank: batchserve-worker@I.service
# The units besides the worker ranks, in start order (systemd stops them in reverse: api first); only
# the machine of node_rank 0 runs them.
SERVER_PROCESSES = tuple(name for name in START_ORDER if name != "worker")
SERVER_UNITS = tuple(f"batchserve-{name}.service" for name in SERVER_PROCESSES)
TEMPLATE_NAMES = (TARGET, WORKER_TEMPLATE, *SERVER_UNITS)  # the files a one-server install writes
# Replicas: every process's unit a template, instance I = replica I, grouped by its target; the router.
REPLICA_TARGET_TEMPLATE = "batchserve@.target"
REPLICA_TEMPLATES = tuple(f"batchserve-{name}@.service" for name in SERVER_PROCESSES)
ROUTER_UNIT = "batchserve-router.service"
# Every unit file some layout installs (one that this machine's does not is removed).
INSTALLED_NAMES = (*TEMPLATE_NAMES, REPLICA_TARGET_TEMPLATE, *REPLICA_TEMPLATES, ROUTER_UNIT)


def worker_unit(local_rank: int) -> str:
    return f"batchserve-worker@{local_rank}.service"


def replica_unit(process: str, replica: int | str) -> str:
    """Replica `replica`'s unit of `process` (`%i` in a template of another replica unit)."""
    return f"batchserve-{process}@{replica}.service"


def replica_target(replica: int | str) -> str:
    return f"batchserve@{replica}.target"


@dataclass(frozen=True)
class MachineUnits:
    """The services one machine runs for a tensor-parallel layout: its worker ranks' instances, and
    on node_rank 0 the rest of the server."""

    workers: tuple[str, ...]
    server: tuple[str, ...]  # scheduler, tokenizer, detokenizer, api (node_rank 0), else none

    @property
    def services(self) -> tuple[str, ...]:
        """In start order: the ranks (together), then the server's units."""
        return self.workers + self.server

    @property
    def templates(self) -> dict[str, str]:
        """The unit files this machine installs: installed name -> its file in systemd/."""
        return {name: name for name in (TARGET, WORKER_TEMPLATE, *self.server)}

    @property
    def names(self) -> dict[str, str]:
        """The templates' placeholders for the units' names: each unit as named."""
        return {
            "@WORKERS@": " ".join(self.workers),
            "@SERVICES@": " ".join(self.services),
            "@AT@": "",
            "@WORKER0@": worker_unit(0),
            "@PART_OF@": TARGET,
            "@REPLICA_FLAG@": "",
            "@WORKER_FLAG@": "--local-rank %i",
            "@WORKER_INSTANCE@": "local rank",
            "@INTERNAL_KEY_ENV@": "",
        }

    def describe(self, config: ServerConfig) -> str:
        first = RankLayout.of(config, 0).rank
        last = first + len(self.workers) - 1
        ranks = f"worker rank {first}" if first == last else f"worker ranks {first}..{last}"
        of = f" of {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
        if self.server:
            return f"This machine runs {ranks}{of} ({', '.join(self.workers)}) and the server's other units.\n"
        return (
            f"This machine (node_rank {config.node_rank} of {config.nnodes}) runs only {ranks}{of} "
            f"({', '.join(self.workers)}); they join global rank 0 at {config.dist_init_addr}, on the "
            "machine of node_rank 0, which serves the api (start either first: each waits "
            f"dist_timeout_s={config.dist_timeout_s:g} for the other).\n"
        )


@dataclass(frozen=True)
class ReplicaUnits:
    """The services of a server run as replicas (data_parallel_size > 1, or a router): replica I's five
    processes as instance I of each unit's template, grouped by batchserve@I.target; then the router."""

    replicas: int
    router: bool

    @property
    def services(self) -> tuple[str, ...]:
        """What batchserve.target wants, in start order: every replica (together), then the router."""
        return tuple(replica_target(i) for i in range(self.replicas)) + ((ROUTER_UNIT,) if self.router else ())

    @property
    def templates(self) -> dict[str, str]:
        """The unit files this machine installs: installed name -> its file in systemd/."""
        files = {TARGET: TARGET, REPLICA_TARGET_TEMPLATE: REPLICA_TARGET_TEMPLATE, WORKER_TEMPLATE: WORKER_TEMPLATE}
        files.update(zip(REPLICA_TEMPLATES, SERVER_UNITS))
        return files | ({ROUTER_UNIT: ROUTER_UNIT} if self.router else {})

    @property
    def names(self) -> dict[str, str]:
        """The templates' placeholders for the units' names: instance %i of each, replica %i's."""
        return {
            "@WORKERS@": replica_unit("worker", "%i"),
            "@SERVICES@": " ".join(self.services),
            "@AT@": "@%i",
            "@WORKER0@": replica_unit("worker", "%i"),
            "@PART_OF@": replica_target("%i"),
            "@REPLICA_FLAG@": " --data-parallel-rank %i",
            "@WORKER_FLAG@": "--data-parallel-rank %i",
            "@WORKER_INSTANCE@": "replica",
            "@REPLICA_SERVICES@": " ".join(replica_unit(name, "%i") for name in START_ORDER),
            "@REPLICA_TARGETS@": " ".join(replica_target(i) for i in range(self.replicas)),
            "@INTERNAL_KEY_ENV@": f"EnvironmentFile=/{ENV_DIR / INTERNAL_KEY_FILE_NAME}" if self.router else "",
        }

    def describe(self, config: ServerConfig) -> str:
        ports = f"{replica_port(config, 0)}..{replica_port(config, self.replicas - 1)}"
        router = (
            f", and {ROUTER_UNIT}: smg ({config.router_policy}) on port {config.port} in front of them"
            if self.router
            else ""
        )
        return (
            f"This machine runs {self.replicas} replica(s), {replica_target(0)} .. "
            f"{replica_target(self.replicas - 1)} (each its worker, scheduler, tokenizer, detokenizer and api: "
            f"{replica_unit('api', 0)} ..; apis on ports {ports}){router}.\n"
        )


Layout = MachineUnits | ReplicaUnits


def machine_units(config: ServerConfig) -> Layout:
    """The units this machine runs for `config` (ValueError naming the setting for a layout that cannot run)."""
    layout = RankLayout.of(config, 0)
    if replicated(config):
        return ReplicaUnits(replicas=config.data_parallel_size, router=config.router != "none")
    return MachineUnits(
        workers=tuple(worker_unit(i) for i in range(layout.local_world_size)),
        server=SERVER_UNITS if config.node_rank == 0 else (),
    )


SINGLE_WORKER = machine_units(ServerConfig())
