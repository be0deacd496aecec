"""`batchserve serve`: start the five processes, wait until each is ready, supervise, drain on signal.

Each child runs `batchserve proc NAME --config runtime_dir/config.json` in its own process group,
with `PR_SET_PDEATHSIG` so that it dies with us, and reports readiness through its own
`$NOTIFY_SOCKET` (the sd_notify protocol, as under systemd). Which children a machine starts, and the
check that its ports are free, are `procs.serve_launches`.

Tensor parallelism (`--tp N`): the worker is this machine's N / nnodes worker ranks, each a child
`batchserve proc worker --local-rank I` named as it heartbeats (`worker`, `worker-1`, ...), started
where the worker starts. With `--node-rank R > 0` this machine serves no api: `serve` starts and
supervises only its worker ranks, which join global rank 0's at `--dist-init-addr`.

Replicas (`--data-parallel-size N`, or a `--router`): N copies of the five processes, replica I's
children started with `--data-parallel-rank I` (named `api@I`, ...: their own port, device and
sockets, `shared.parallel`), and once every one is ready, the router (`batchserve router`, smg in front
of them). Once all are serving, a replica whose process dies is stopped as a whole (its api first
ends the requests it had with their terminal events) and the others serve on: the router stops
sending to it when its /health fails; `serve` exits 1 when no replica is left, or when the router ends.
Once stopped, that replica's processes are done with: their shared memory is removed then, and they are
never signalled again (their pids may belong to other processes by the time `serve` stops).
The router and the replicas' apis share a key made for this start (`INTERNAL_KEY_ENV` in their
environment alone), smg's control-plane key and the one it presents to the replicas (procs/router.py).

SIGINT/SIGTERM: the api (every replica's, and the router) is stopped first (it answers 503 to new
requests and lets running ones finish for up to `drain_timeout_s`), then the rest. A second signal stops
everything at once. Before every process is ready, a signal stops them all at once (exit 0). A child
that took the same signal (Ctrl-C or `kill` reaching every process) and ended as a stop does
(`STOP_EXIT_STATUSES`) is part of that stop, not a failure. If any process dies on its own, the others
are stopped and `serve` exits 1 naming it.
"""

from __future__ import annotations

import argparse
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

from batchserve.procs.api.auth import INTERNAL_KEY_ENV, new_internal_key
from batchserve.procs.router import check_router
from batchserve.procs.runtime import configured_runtime_dir, die_with_parent, make_private_dir
from batchserve.procs.serve_launches import ROUTER, Launch, check_can_listen, launches, listen_ports
from batchserve.shared.commands import cli_command
from batchserve.shared.config import ServerConfig, add_config_arguments, config_from_args
from batchserve.shared.parallel import (
    check_parallel_config,
    local_url,
    replica_urls,
    replicated,
    with_init_addr,
)
from batchserve.shared.shm import remove_segments_of

BACKEND_STOP_TIMEOUT_S = 10.0
EXIT_POLL_S = 0.02  # how often the stop looks for exited children
# How a child ends when it takes the stop signal itself (Ctrl-C reaching the whole tree, `kill` of every
# process): 0 (its own stop), 130 (KeyboardInterrupt before its handlers), or killed by the signal.
STOP_EXIT_STATUSES = frozenset({0, 130, -signal.SIGINT, -signal.SIGTERM})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def _say(message: str) -> None:
    print(f"batchserve serve: {message}", file=sys.stderr, flush=True)


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: own process group, die with the parent."""
    os.setpgid(0, 0)
    die_with_parent(parent_pid)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    notify: socket.socket
    launch: Launch
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
        # children of failed replicas, stopped and reaped: kept for the exit report, never signalled again
        self.retired: dict[str, Child] = {}
        # the router's internal key, for the router and the replicas' apis (procs/router.py)
        self.internal_key = new_internal_key() if config.router != "none" else None
        self.signals = 0
        self.signal_name = ""  # the first stop signal's name (SIGINT, SIGTERM)
        self.stop_seconds: dict[str, float] = {}  # each stopped child's seconds from SIGTERM to its exit
        self.config_path = runtime_dir / "config.json"
        self.failed_replicas: set[int] = set()  # stopped after one of their processes died

    # -- signals ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        self.signal_name = self.signal_name or signal.Signals(signum).name

    # -- start --------------------------------------------------------------------------------
    def _spawn(self, launch: Launch) -> Child:
        name = launch.key
        notify_path = self.runtime_dir / f"notify-{name}.sock"
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(str(notify_path))
        env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), PYTHONUNBUFFERED="1")
        env.pop(INTERNAL_KEY_ENV, None)
        if self.internal_key is not None and launch.process in ("router", "api"):
            env[INTERNAL_KEY_ENV] = self.internal_key
        parent = os.getpid()
        config = ["--config", str(self.config_path)]
        if launch.process == "router":
            command = cli_command("router", *config)
        else:
            command = cli_command("proc", launch.process, *config)
        if launch.process == "worker" and self.config.tensor_parallel_size > 1:
            command += ["--local-rank", str(launch.local_rank)]
        if launch.replica is not None:
            command += ["--data-parallel-rank", str(launch.replica)]
        popen = subprocess.Popen(command, env=env, preexec_fn=lambda: _child_setup(parent), close_fds=True)
        return Child(name, popen, notify, launch)

    def _start(self, launch: Launch) -> None:
        self.children[launch.key] = self._spawn(launch)

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

    def _dead_children(self) -> list[Child]:
        """Children that exited on their own: not those stopped by us, nor, once we were asked to stop,
        those that took the same stop themselves."""
        return [
            child
            for child in self.children.values()
            if child.popen.poll() is not None and not child.expected_exit and not self._took_the_stop(child)
        ]

    def _took_the_stop(self, child: Child) -> bool:
        return self.signals > 0 and child.popen.returncode in STOP_EXIT_STATUSES

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> int:
        self.config_path.write_bytes(msgspec.json.format(self.config.to_json()))
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            for launch in launches(self.config):
                self._start(launch)
            return self._supervise()
        finally:
            self._stop_all()
            self._cleanup()

    def _supervise(self) -> int:
        started = time.monotonic()
        announced = False
        while True:
            self._read_notifications(0.2)
            if self._group_stopped():
                _say("global rank 0 stopped the worker group; this machine's worker ranks exited")
                return 0
            if self.signals and not announced:  # before the dead: a child may have taken the signal too
                _say(f"{self.signal_name}: stopping before every process was ready")
                return 0
            if self._dead_children() and not (announced and self._stop_failed_replicas()):
                self._report_dead("; stopping the others")
                return 1
            if self.signals:
                return self._drain()
            everyone_ready = all(c.ready for c in self.children.values())
            if everyone_ready and self.config.router != "none" and ROUTER.key not in self.children:
                self._start(ROUTER)  # in front of the replicas once they serve, as its unit's After= orders it
            elif not announced and everyone_ready:
                announced = True
                print(self._ready_line(time.monotonic() - started), flush=True)

    def _stop_failed_replicas(self) -> bool:
        """A replica's process died after the server was up: stop that replica (its api first ends what it
        had in flight: the others' heartbeats are gone), retire its processes, and let the others serve on.
        False when that cannot be: the router ended, or no replica is left."""
        dead = self._dead_children()
        if any(child.launch.replica is None for child in dead):  # the router, or a server that is one replica
            return False
        replicas = {child.launch.replica for child in dead if child.launch.replica is not None}
        left = set(range(self.config.data_parallel_size)) - self.failed_replicas - replicas
        if not left:
            return False
        self._report_dead(
            f"; stopping replica {', '.join(map(str, sorted(replicas)))}, replica "
            f"{', '.join(map(str, sorted(left)))} serves on"
        )
        self.failed_replicas |= replicas
        failed = [child for child in self.children.values() if child.launch.replica in replicas]
        self._stop(failed)
        for child in failed:
            self._retire(child)
        return True

    def _retire(self, child: Child) -> None:
        """A stopped and reaped child is done with: remove what it left in /dev/shm (a killed process could
        not) and its notify socket now, and move it out of `children`, so that no later stop signals its
        pid or removes segments by it: by then either may be another process's."""
        self._release(child)
        self.retired[child.name] = self.children.pop(child.name)

    def _release(self, child: Child) -> None:
        """What an exited child leaves: its notify socket, and its segments in /dev/shm (a killed process
        could not unlink them itself)."""
        child.notify.close()
        remove_segments_of(child.pid)
        (self.runtime_dir / f"notify-{child.name}.sock").unlink(missing_ok=True)

    def _ready_line(self, seconds: float) -> str:
        pids = " ".join(f"{c.name}={c.pid}" for c in self.children.values())
        model = self.config.served_model_name or self.config.model
        if self.config.node_rank > 0:
            return (
                f"batchserve: serving worker ranks of {model} for node 0 at {self.config.dist_init_addr}, "
                f"node {self.config.node_rank} of {self.config.nnodes}, no api here (ready in {seconds:.1f}s; "
                f"{pids}; runtime dir {self.runtime_dir})"
            )
        if replicated(self.config):
            replicas = f"{self.config.data_parallel_size} replica(s) at {' '.join(replica_urls(self.config))}"
            where = (
                f"at {local_url(self.config.host, self.config.port)} through {self.config.router} "
                f"({self.config.router_policy}) over {replicas}"
                if self.config.router != "none"
                else f"on {replicas}"
            )
            return (
                f"batchserve: serving {model} {where} (ready in {seconds:.1f}s; {pids}; runtime dir {self.runtime_dir})"
            )
        return (
            f"batchserve: serving {model} at http://{self.config.host}:{self.config.port} (ready in "
            f"{seconds:.1f}s; {pids}; runtime dir {self.runtime_dir})"
        )

    def _group_stopped(self) -> bool:
        """On a machine of worker ranks only: a ready rank exited 0, which a follower does when rank 0
        broadcasts its stop (node 0's server stopping), not a failure."""
        dead = self._dead_children()
        return (
            self.config.node_rank > 0
            and bool(dead)
            and all(child.ready and child.popen.returncode == 0 for child in dead)
        )

    def _report_dead(self, suffix: str) -> bool:
        """Name the children that exited unexpectedly, if any (True: one did). Every one: when a worker
        rank dies the others' collectives fail soon after, and either may be seen first."""
        dead = self._dead_children()
        if not dead:
            return False
        _say(
            "; ".join(
                f"the {child.name} process (pid {child.pid}) exited with status "
                f"{_describe_status(child.popen.returncode)}"
                for child in dead
            )
            + suffix
        )
        return True

    def _front(self) -> list[Child]:
        """What clients talk to, stopped first: the router, then every live replica's api."""
        return [
            child
            for child in sorted(self.children.values(), key=_stop_order)
            if child.launch.process in ("router", "api") and child.popen.poll() is None
        ]

    def _drain(self) -> int:
        """Stop the router and the apis first (they drain), then the backend; a second signal cuts it short."""
        front = self._front()
        if not front:  # a machine of worker ranks only: rank 0's node drains, its stop ends ours
            _say("stopping this machine's worker ranks")
            return 0
        _say(f"draining (up to {self.config.drain_timeout_s:g}s); signal again to stop now")
        signals_seen = self.signals
        for child in front:
            child.expected_exit = True
            child.signal(signal.SIGTERM)
        asked = time.monotonic()
        deadline = asked + self.config.drain_timeout_s + BACKEND_STOP_TIMEOUT_S
        waiting = list(front)
        while waiting and time.monotonic() < deadline and self.signals == signals_seen:
            self._read_notifications(EXIT_POLL_S)
            if self._report_dead(" while draining"):
                return 1
            for child in [c for c in waiting if c.popen.poll() is not None]:
                self.stop_seconds[child.name] = time.monotonic() - asked
                waiting.remove(child)
        for child in waiting:
            _say(f"the {child.name} did not finish draining in time; stopping it")
        return 0

    # -- stop ---------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        """SIGTERM every live process (the router and the apis first), wait, then SIGKILL their groups.
        Follower worker ranks then exit on rank 0's stop broadcast (or by themselves within a few seconds)."""
        self._stop(list(self.children.values()))
        if self.stop_seconds:
            every = {**self.retired, **self.children}
            _say(
                "stopped; seconds from SIGTERM to exit: "
                + ", ".join(
                    f"{name} {seconds:.2f}{_exit_note(every[name].popen.returncode)}"
                    for name, seconds in self.stop_seconds.items()
                )
            )
        elif self.signals:  # nothing left to stop: each process took the signal itself
            _say(f"stopped; every process had stopped on {self.signal_name} itself")

    def _stop(self, children: list[Child]) -> None:
        """SIGTERM `children` that still run, all at once, the router and apis first; wait for them, then
        SIGKILL their groups."""
        in_order = sorted(children, key=_stop_order)
        running = [child for child in in_order if child.popen.poll() is None]
        for child in in_order:
            child.expected_exit = True
        for child in running:
            child.signal(signal.SIGTERM)
            child.signal(signal.SIGCONT)  # a stopped (SIGSTOP) process takes SIGTERM only once running
        self.stop_seconds.update(self._wait_for_exits(running, BACKEND_STOP_TIMEOUT_S))
        for child in in_order:
            if child.popen.poll() is None:
                _say(f"the {child.name} process (pid {child.pid}) did not stop; killing it")
            child.signal(signal.SIGKILL)  # also reaps helpers left in its group
            if child.popen.poll() is None:
                child.popen.wait()

    @staticmethod
    def _wait_for_exits(children: list[Child], timeout_s: float) -> dict[str, float]:
        """Wait up to `timeout_s` for `children` to exit; each one's seconds to its exit (as seen here,
        within a poll), in the order they exited."""
        started = time.monotonic()
        exits: dict[str, float] = {}
        waiting = list(children)
        while waiting and time.monotonic() - started < timeout_s:
            time.sleep(EXIT_POLL_S)
            for child in [c for c in waiting if c.popen.poll() is not None]:
                exits[child.name] = time.monotonic() - started
                waiting.remove(child)
        return exits

    def _cleanup(self) -> None:
        for child in self.children.values():
            self._release(child)
        if self.owns_runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _stop_order(child: Child) -> int:
    """The router first, then the apis, then the rest in start order (sorting is stable)."""
    return {"router": 0, "api": 1}.get(child.launch.process, 2)


def _exit_note(code: int | None) -> str:
    """How a stopped child ended, where that was not status 0 (a child stopped before its signal
    handlers were installed ends by SIGTERM itself)."""
    if code == 0:
        return ""
    if code is not None and code < 0:
        try:
            return f" (by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f" (status {code})"


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
    from batchserve.procs.scheduler.config import check_config

    config = config_from_args(args)
    check_config(config)  # a bad policy/budget combination: one line now, not after loading the model
    check_parallel_config(config)
    check_router(config)
    for port in listen_ports(config):  # machines of worker ranks only serve no api
        check_can_listen(config.host, port)
    config = with_init_addr(config)  # two servers on one machine: their ranks meet at different ports
    chosen = configured_runtime_dir(config)
    if chosen:
        runtime_dir, owns = make_private_dir(Path(chosen)), False
    else:
        runtime_dir, owns = Path(tempfile.mkdtemp(prefix="batchserve-")), True
    config = msgspec.structs.replace(config, runtime_dir=str(runtime_dir))
    return Supervisor(config, runtime_dir, owns_runtime_dir=owns).run()
