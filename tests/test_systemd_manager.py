"""The installed units under a real systemd: a user manager (`systemd --user`) in a private mount
namespace, so nothing of it is visible outside the test. It starts `batchserve.target`, which must
reach `active` only once all five services sent READY=1; one HTTP request is served; the worker is
killed with SIGKILL and must come back with every unit that needs it restarted after it; a second
request is served; stopping the target must stop every service cleanly (exit 0 within
TimeoutStopSec=, so `Result=success`). With two tensor-parallel ranks (`--tp 2`: instances 0 and 1
of `batchserve-worker@.service`): a follower killed, then a follower stopped on its own, must each
bring the whole set back (every rank and every unit after them restarted), then a clean stop. With
two replicas behind the router (`--dp 2 --router smg`: instances 0 and 1 of every process's template,
`batchserve@I.target`, `batchserve-router.service`): requests through the router; replica 1's worker
killed brings back replica 1's units alone while the router (never restarted) serves from replica 0;
then a clean stop, the router first.

What differs from a system install: a user manager cannot switch users, so `User=`, `Group=` and
`SupplementaryGroups=` are dropped from the copies; `EnvironmentFile=` points at the staged env
file (and key file); there is no journald, so `StandardOutput=`/`StandardError=` append to files; an added
`ExecStopPost=` records how each main process ended (a cleanly stopped unit is unloaded). Everything
else (Type=notify, ordering, Requires=/PartOf=, RuntimeDirectory=, the sandboxing) is the
installed text. Files live under /dev/shm: `PrivateTmp=yes` hides /tmp, and
/dev/shm is visible to every unit (the processes share memory through it).

Skipped where a manager cannot run: not root, no systemd binary, or no mount namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchserve.procs import install_systemd as inst
from batchserve.procs.api.auth import INTERNAL_KEY_ENV
from batchserve.procs.router import healthy_workers
from batchserve.shared.ports import free_port

SYSTEMD = Path("/lib/systemd/systemd")
DROPPED_KEYS = ("User=", "Group=", "SupplementaryGroups=")
START_LIMIT_S = 300.0

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not SYSTEMD.exists() or shutil.which("unshare") is None or shutil.which("systemctl") is None,
    reason="needs root, systemd, systemctl and unshare to run a private systemd user manager",
)


class UserManager:
    """`systemd --user` in its own mount namespace (so /run/systemd/system can exist only there)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "XDG_RUNTIME_DIR": str(base / "xdg"),
            "XDG_CONFIG_HOME": str(base / "config"),
            "XDG_CACHE_HOME": str(base / "cache"),
            "XDG_STATE_HOME": str(base / "state"),
            "XDG_DATA_HOME": str(base / "data"),
            "HOME": str(base / "home"),
        }
        for key in ("XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "HOME"):
            Path(self.env[key]).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.unit_dir = base / "config" / "systemd" / "user"
        self.unit_dir.mkdir(parents=True)
        self.log = (base / "manager.log").open("wb")
        # A fresh /run for the manager alone: /run/systemd/system marks "booted with systemd"; the
        # inaccessible nodes are what PID 1 creates at boot and what ProtectHome=,
        # ProtectKernelTunables=, ... mount over the paths they hide.
        boot = (
            "mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system /run/systemd/inaccessible && "
            "cd /run/systemd/inaccessible && touch reg && mkdir dir && mknod chr c 0 0 && mknod blk b 0 0 && "
            f"mkfifo fifo && {sys.executable} -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")' && "
            "chmod 0000 reg dir chr blk fifo sock && cd / && "
            f"exec {SYSTEMD} --user --log-target=console --log-level=notice"
        )
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", boot],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def systemctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["systemctl", "--user", "--no-pager", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def wait_up(self, timeout_s: float = 20) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.systemctl("show", "-p", "Version").returncode == 0:
                return True
            time.sleep(0.2)
        return False

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self) -> str:
        status = self.systemctl("status", "batchserve-*", "-n", "30").stdout
        logs = "".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}\n"
            for p in sorted((self.base / "logs").glob("*.log"))
        )
        return f"{status}\n{logs}--- manager\n{(self.base / 'manager.log').read_text(errors='replace')[-3000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the manager stops its units, then exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def run_base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bs-sdm-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def complete(port: int) -> dict:
    """One completion; the api reports healthy a heartbeat after READY, so a 503 is retried briefly."""
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
                model_id = json.load(response)["data"][0]["id"]
            request = urllib.request.Request(
                f"{base}/v1/completions",
                method="POST",
                headers={"Content-Type": "application/json"},
                data=json.dumps({"model": model_id, "prompt": "w5 w6 w7", "max_tokens": 3, "temperature": 0}).encode(),
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def main_pids(manager: UserManager, services: list[str]) -> dict[str, str]:
    return {name: manager.show(name, "MainPID")["MainPID"] for name in services}


def wait_all_active(
    manager: UserManager, services: list[str], timeout_s: float, previous: dict[str, str] | None = None
) -> dict[str, str]:
    """Every service active/running (with a MainPID other than `previous`'s, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {n: manager.show(n, "ActiveState", "SubState", "MainPID") for n in services}
        if all(s["ActiveState"] == "active" and s["SubState"] == "running" for s in states.values()):
            pids = {n: s["MainPID"] for n, s in states.items()}
            if previous is None or all(pids[n] != previous[n] for n in services):
                return pids
        time.sleep(0.5)
    raise AssertionError(f"not every service came up within {timeout_s:.0f}s: {states}\n{manager.journal()}")


def start_server(run_base: Path, model: Path, *layout: str) -> tuple[UserManager, list[str], int]:
    """Install for the `layout` flags under run_base, stage the units in a fresh user manager, start the
    target: (manager, the services the target wants, a replica's target standing for its services, and
    the port clients call). Skips where no manager runs."""
    prefix = run_base / "root"
    batchserve = Path(sys.prefix) / "bin" / "batchserve"
    installed = subprocess.run(
        [str(batchserve), "install-systemd", "--prefix", str(prefix), *layout],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert installed.returncode == 0, installed.stderr
    model = shutil.copytree(model, run_base / "model")
    port = free_port(span=8)
    env_file = prefix / inst.ENV_DIR / inst.ENV_FILE_NAME
    with env_file.open("a") as f:
        f.write(
            f"BATCHSERVE_MODEL={model}\nBATCHSERVE_PORT={port}\nBATCHSERVE_DEVICE=cpu\n"
            f"BATCHSERVE_KV_CAPACITY_TOKENS=4096\n"
        )
        # not the standalone default port, which another test's ranks may hold
        f.write(f"BATCHSERVE_DIST_INIT_ADDR=127.0.0.1:{free_port()}\n")

    (run_base / "logs").mkdir()
    manager = UserManager(run_base)
    if not manager.wait_up():
        manager.close()
        pytest.skip(f"a systemd user manager does not run here:\n{manager.journal()}")
    for path in sorted((prefix / inst.UNIT_DIR).iterdir()):
        name = path.name
        lines = path.read_text().splitlines()
        lines = [line for line in lines if not line.startswith(DROPPED_KEYS)]
        # the staged env file (and the router's key file) in place of /etc/batchserve's
        lines = [
            line.replace(f"=/{inst.ENV_DIR}/", f"={prefix / inst.ENV_DIR}/")
            if line.startswith("EnvironmentFile=")
            else line
            for line in lines
        ]
        # No journald in the private manager: what would go to the journal goes to a file (%n: the
        # instance's own name, batchserve-worker@1.service).
        lines = [
            f"{line.split('=')[0]}=append:{run_base / 'logs'}/%n.log"
            if line.startswith(("StandardOutput=", "StandardError="))
            else line
            for line in lines
        ]
        if name.endswith(".service"):  # record how each main process ended, and when
            lines.append(
                'ExecStopPost=/bin/sh -c \'echo "%n $$EXIT_CODE $$EXIT_STATUS $$(date +%%s.%%N)" '
                ">> $$RUNTIME_DIRECTORY/exits.log'"
            )
        (manager.unit_dir / name).write_text("\n".join(lines) + "\n")
    assert manager.systemctl("daemon-reload").returncode == 0
    target = inst.read_unit((prefix / inst.UNIT_DIR / inst.TARGET).read_text())
    services = []
    for name in " ".join(inst.unit_values(target, "Unit", "Wants")).split():
        if name.endswith(".target"):  # a replica's: its five units
            replica = inst.read_unit(
                (prefix / inst.UNIT_DIR / inst.REPLICA_TARGET_TEMPLATE)
                .read_text()
                .replace("%i", name.split("@")[1].removesuffix(".target"))
            )
            services += " ".join(inst.unit_values(replica, "Unit", "Wants")).split()
        else:
            services.append(name)

    # The target's start job finishes only when every service sent READY=1 (After= + Type=notify).
    started = time.monotonic()
    result = manager.systemctl("start", "batchserve.target", timeout=START_LIMIT_S)
    assert result.returncode == 0, f"{result.stderr}\n{manager.journal()}"
    print(f"batchserve.target active {time.monotonic() - started:.1f}s after start")
    return manager, services, port


def exits(run_base: Path) -> list[list[str]]:
    """How each main process ended so far: [unit, EXIT_CODE, EXIT_STATUS, time]."""
    return [line.split() for line in (run_base / "xdg" / "batchserve" / "exits.log").read_text().splitlines()]


def stop_cleanly(
    manager: UserManager, services: list[str], run_base: Path, first: str = "batchserve-api.service"
) -> list[list[str]]:
    """Stop the target: `first` (the api, or the router in front of replicas) first, the worker ranks
    last; each drains and exits 0 within its TimeoutStopSec=. Returns every recorded end."""
    result = manager.systemctl("stop", "batchserve.target", timeout=120)
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = {n: manager.show(n, "ActiveState", "Result") for n in services}
        if all(s["ActiveState"] in ("inactive", "failed") for s in states.values()):
            break
        time.sleep(0.5)
    # A unit that failed (non-zero exit, TimeoutStopSec= hit) stays loaded as 'failed'.
    assert all(s["ActiveState"] == "inactive" for s in states.values()), (states, manager.journal())
    ends = exits(run_base)
    print("\n".join(" ".join(end) for end in ends))
    final = {name: (code, status, float(at)) for name, code, status, at in ends}  # the last end of each
    for name in services:
        assert final[name][:2] == ("exited", "0"), (name, final[name], manager.journal())
    stopped = sorted(services, key=lambda n: final[n][2])
    workers = [name for name in services if name.startswith("batchserve-worker@")]
    assert stopped[0] == first, ends
    for instance in {
        name.split("@")[1] for name in services if "@" in name and not name.startswith("batchserve-worker@")
    }:
        mine = [name for name in stopped if name.endswith(f"@{instance}")]  # a replica: api first, worker last
        assert mine[0].startswith("batchserve-api@") and mine[-1].startswith("batchserve-worker@"), ends
    if not any("@" in name and not name.startswith("batchserve-worker@") for name in services):
        assert set(stopped[-len(workers) :]) == set(workers), ends
    # RuntimeDirectoryPreserve=yes: the shared directory outlives the units.
    assert (run_base / "xdg" / "batchserve").is_dir()
    return ends


def test_units_under_systemd_start_restart_together_and_stop_cleanly(
    run_base: Path, tiny_model_dir: Callable[..., Path]
) -> None:
    manager, services, port = start_server(run_base, tiny_model_dir("llama", with_tokenizer=True))
    assert services == [inst.worker_unit(0), *inst.SERVER_UNITS]
    worker = inst.worker_unit(0)
    try:
        pids = wait_all_active(manager, services, 10)  # Wants= lets the target succeed even if a service failed
        assert (run_base / "xdg" / "batchserve" / "worker.sock").exists()  # RuntimeDirectory=
        assert complete(port)["usage"]["completion_tokens"] >= 1

        # A dead worker: it is restarted, and so is every unit that needs it, after it.
        os.kill(int(pids[worker]), signal.SIGKILL)
        killed = time.monotonic()
        new_pids = wait_all_active(manager, services, START_LIMIT_S, previous=pids)
        print(f"all five restarted {time.monotonic() - killed:.1f}s after the worker was killed")
        assert manager.show(worker, "NRestarts")["NRestarts"] == "1"
        assert complete(port)["usage"]["completion_tokens"] >= 1

        ends = stop_cleanly(manager, services, run_base)
        assert (worker, "killed", "KILL") in [tuple(e[:3]) for e in ends]
        assert new_pids != pids
    finally:
        manager.close()


def test_two_worker_ranks_under_systemd_come_back_as_a_set(run_base: Path, tiny_model_dir: Callable[..., Path]) -> None:
    manager, services, port = start_server(run_base, tiny_model_dir("llama", with_tokenizer=True), "--tp", "2")
    assert services == [inst.worker_unit(0), inst.worker_unit(1), *inst.SERVER_UNITS]
    follower = inst.worker_unit(1)
    try:
        pids = wait_all_active(manager, services, 10)
        assert complete(port)["usage"]["completion_tokens"] >= 1

        # A dead follower ends the group: rank 0 exits at its next collective; the restarts (the
        # follower's own, rank 0's, which restarts every rank and every unit after it) bring back all.
        os.kill(int(pids[follower]), signal.SIGKILL)
        killed = time.monotonic()
        pids = wait_all_active(manager, services, START_LIMIT_S, previous=pids)
        print(f"all six restarted {time.monotonic() - killed:.1f}s after worker rank 1 was killed")
        assert complete(port)["usage"]["completion_tokens"] >= 1

        # A follower stopped on its own: nothing restarts it by itself (an explicit stop), but rank 0,
        # whose group it ended, fails and restarts, and its start pulls the follower back in (Wants=).
        result = manager.systemctl("stop", follower, timeout=120)
        assert result.returncode == 0, result.stderr
        stopped = time.monotonic()
        pids = wait_all_active(manager, services, START_LIMIT_S, previous=pids)
        print(f"all six back {time.monotonic() - stopped:.1f}s after worker rank 1 was stopped alone")
        assert complete(port)["usage"]["completion_tokens"] >= 1

        ends = [tuple(e[:3]) for e in stop_cleanly(manager, services, run_base)]
        assert (follower, "killed", "KILL") in ends and (follower, "exited", "0") in ends
        assert (inst.worker_unit(0), "exited", "1") in ends  # rank 0 left a broken group with status 1
    finally:
        manager.close()


def test_two_replicas_behind_the_router_under_systemd(run_base: Path, tiny_model_dir: Callable[..., Path]) -> None:
    if not (Path(sys.prefix) / "bin" / "smg").is_file():
        pytest.skip("smg is not installed in this venv (pip install -e '.[router]'): no router unit")
    manager, services, port = start_server(
        run_base, tiny_model_dir("llama", with_tokenizer=True), "--dp", "2", "--router", "smg"
    )
    replica = {i: [inst.replica_unit(name, i) for name in ("worker", *inst.SERVER_PROCESSES)] for i in (0, 1)}
    assert services == [*replica[0], *replica[1], inst.ROUTER_UNIT]
    try:
        pids = wait_all_active(manager, services, 10)
        assert (run_base / "xdg" / "batchserve" / "replica-1" / "worker.sock").exists()  # each replica's sockets
        for target in (port, port + 1, port + 2):  # the router, and each replica directly
            assert complete(target)["usage"]["completion_tokens"] >= 1
        # smg's control plane: closed to clients, open to the key install-systemd made for the router
        key_file = run_base / "root" / inst.ENV_DIR / inst.INTERNAL_KEY_FILE_NAME
        key = inst.read_env_file(key_file.read_text())[INTERNAL_KEY_ENV]
        assert healthy_workers(f"http://127.0.0.1:{port}", key) == {
            f"http://127.0.0.1:{port + 1}",
            f"http://127.0.0.1:{port + 2}",
        }
        assert healthy_workers(f"http://127.0.0.1:{port}") == set()  # 401 without it

        # Replica 1's worker dies: its units come back after it, replica 0 and the router go on.
        os.kill(int(pids[replica[1][0]]), signal.SIGKILL)
        killed = time.monotonic()
        assert complete(port)["usage"]["completion_tokens"] >= 1  # through the router, meanwhile
        new_pids = wait_all_active(manager, replica[1], START_LIMIT_S, previous={n: pids[n] for n in replica[1]})
        print(f"replica 1 restarted {time.monotonic() - killed:.1f}s after its worker was killed")
        assert main_pids(manager, [*replica[0], inst.ROUTER_UNIT]) == {
            n: pids[n] for n in (*replica[0], inst.ROUTER_UNIT)
        }
        assert complete(port + 2)["usage"]["completion_tokens"] >= 1 and new_pids

        ends = [tuple(e[:3]) for e in stop_cleanly(manager, services, run_base, first=inst.ROUTER_UNIT)]
        assert (replica[1][0], "killed", "KILL") in ends
    finally:
        manager.close()
