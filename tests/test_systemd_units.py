"""The systemd units and env file: generated env file in sync with ServerConfig, install-systemd's
behaviour (for one worker, two ranks, a machine of node_rank 1, and replicas with and without a router),
dependency/readiness/draining settings, the worker ranks' template, the replicas' templates, and
`systemd-analyze verify` on rendered units."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from batchserve.procs import install_systemd as inst
from batchserve.procs.api.auth import INTERNAL_KEY_ENV
from batchserve.shared.config import ServerConfig, config_from_args

SERVICES = list(inst.SINGLE_WORKER.services)
WORKER = inst.worker_unit(0)
TWO_RANKS = ("--tp", "2")
NODE_1 = ("--tp", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:29500")
TWO_REPLICAS = ("--dp", "2")
REPLICA_SERVICES = [inst.replica_unit(name, i) for i in range(2) for name in ("worker", *inst.SERVER_PROCESSES)]


def run_install(*argv: str) -> subprocess.CompletedProcess[str]:
    batchserve = Path(sys.prefix) / "bin" / "batchserve"  # the console script, as a user runs it
    return subprocess.run(
        [str(batchserve), "install-systemd", *argv], capture_output=True, text=True, timeout=60, cwd=inst.SOURCE_DIR
    )


def unit_file(name: str) -> str:
    """The file a unit is loaded from: an instance (batchserve-worker@1.service, batchserve@1.target)
    from its template."""
    prefix, at, rest = name.partition("@")
    return f"{prefix}@.{rest.rpartition('.')[2]}" if at else name


def load_units(prefix: Path, names: tuple[str, ...] | list[str]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Each unit as systemd reads it; an instance's %i replaced by its instance name."""
    loaded = {}
    for name in names:
        text = (prefix / inst.UNIT_DIR / unit_file(name)).read_text()
        instance = name.partition("@")[2].rpartition(".")[0]
        loaded[name] = inst.read_unit(text.replace("%i", instance) if instance else text)
    return loaded


def words(unit: dict, section: str, key: str) -> list[str]:
    return " ".join(inst.unit_values(unit, section, key)).split()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_layout(tmp_path_factory, "root")[0]


@pytest.fixture(scope="module")
def units(installed: Path) -> dict[str, dict[str, list[tuple[str, str]]]]:
    return load_units(installed, [inst.TARGET, *SERVICES])


def install_layout(
    tmp_path_factory: pytest.TempPathFactory, name: str, *layout: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """An install of `layout` under a fresh prefix, and what it printed."""
    prefix = tmp_path_factory.mktemp(name)
    result = run_install("--prefix", str(prefix), *layout)
    assert result.returncode == 0, result.stderr
    return prefix, result


@pytest.fixture(scope="module")
def installed_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return install_layout(tmp_path_factory, "root-tp2", *TWO_RANKS)


@pytest.fixture(scope="module")
def installed_node_1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return install_layout(tmp_path_factory, "root-node1", *NODE_1)


def seconds(value: str) -> float:
    """A systemd time span as written in these units: 45s, 5min, 30min."""
    for suffix, factor in (("min", 60), ("s", 1)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


# --- the env file ---------------------------------------------------------------------------------


def test_example_env_file_is_generated_from_server_config() -> None:
    shipped = (inst.TEMPLATE_DIR / inst.ENV_FILE_NAME).read_text()
    assert shipped == inst.render_env_file(), (
        "systemd/batchserve.env is out of date; regenerate it with: .venv/bin/python -c "
        '"from batchserve.procs.install_systemd import render_env_file; '
        "open('systemd/batchserve.env','w').write(render_env_file())\""
    )


def test_env_file_documents_every_field_and_reads_back_as_defaults() -> None:
    text = inst.render_env_file()
    fields = msgspec.structs.fields(ServerConfig)
    for field in fields:
        assert f"{inst.env_var(field.name)}=" in text
    # Uncommenting every line must give exactly the defaults, except the deliberate overrides.
    uncommented = "\n".join(line[1:] if line.startswith("#BATCHSERVE_") else line for line in text.splitlines())
    env = inst.read_env_file(uncommented)
    assert set(env) == {inst.env_var(f.name) for f in fields}
    config = config_from_args(argparse.Namespace(), env=env)
    expected = msgspec.structs.replace(ServerConfig(), **inst.ENV_FILE_OVERRIDES)
    assert config == expected
    assert "\nBATCHSERVE_LOG_FORMAT=json\n" in text  # journald gets one JSON object per line


# --- install-systemd ------------------------------------------------------------------------------


def test_install_writes_units_for_this_venv(installed: Path) -> None:
    assert sorted(p.name for p in (installed / inst.UNIT_DIR).iterdir()) == sorted(inst.TEMPLATE_NAMES)
    for name in inst.TEMPLATE_NAMES:
        text = (installed / inst.UNIT_DIR / name).read_text()
        assert inst._PLACEHOLDER.search(text) is None, f"{name} still has a placeholder"
    exec_start = inst.unit_values(
        inst.read_unit((installed / inst.UNIT_DIR / "batchserve-api.service").read_text()), "Service", "ExecStart"
    )
    assert exec_start == [f"{Path(sys.prefix).absolute()}/bin/batchserve proc api"]
    assert (installed / inst.ENV_DIR / inst.ENV_FILE_NAME).read_text() == inst.render_env_file()


def test_install_keeps_an_existing_env_file_unless_forced(tmp_path: Path) -> None:
    env_file = tmp_path / inst.ENV_DIR / inst.ENV_FILE_NAME
    env_file.parent.mkdir(parents=True)
    env_file.write_text("BATCHSERVE_PORT=9999\n")
    result = run_install("--prefix", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert env_file.read_text() == "BATCHSERVE_PORT=9999\n"
    assert "keep" in result.stdout and str(env_file) in result.stdout
    assert (tmp_path / inst.UNIT_DIR / inst.WORKER_TEMPLATE).is_file()
    result = run_install("--prefix", str(tmp_path), "--force")
    assert result.returncode == 0, result.stderr
    assert env_file.read_text() == inst.render_env_file()


def test_dry_run_prints_and_writes_nothing(tmp_path: Path) -> None:
    result = run_install("--prefix", str(tmp_path), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []
    for name in inst.TEMPLATE_NAMES:
        assert f"would write {tmp_path / inst.UNIT_DIR / name}" in result.stdout
    assert "ExecStart=" in result.stdout and "BATCHSERVE_LOG_FORMAT=json" in result.stdout
    assert "systemctl daemon-reload && systemctl enable --now batchserve.target" in result.stdout
    assert "useradd --system" in result.stdout


def test_bad_venv_is_a_clear_error(tmp_path: Path) -> None:
    result = run_install("--prefix", str(tmp_path), "--venv", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "bin/batchserve does not exist" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_venv_path_that_systemd_would_split_is_refused(tmp_path: Path) -> None:
    venv = tmp_path / "my venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "batchserve").write_text("")
    result = run_install("--prefix", str(tmp_path / "root"), "--venv", str(venv))
    assert result.returncode == 2 and "would need escaping" in result.stderr
    assert not (tmp_path / "root").exists()


def test_protect_home_relaxed_only_for_code_under_home() -> None:
    template = (inst.TEMPLATE_DIR / "batchserve-api.service").read_text()
    assert "ProtectHome=yes" in inst.render_unit(template, Path("/opt/venv"), Path("/opt/src"))
    assert inst.needs_home_access(Path("/home/someone/venv"))
    assert inst.needs_home_access(Path("/root/.pyenv/versions/3.11.7/bin/python3"))
    assert not inst.needs_home_access(Path("/opt/venv"), Path("/srv/batchserve"))
    with pytest.raises(ValueError, match="@NEW@"):
        inst.render_unit(template + "\n# @NEW@\n", Path("/opt/venv"))


def test_private_tmp_relaxed_only_for_code_under_tmp() -> None:
    template = (inst.TEMPLATE_DIR / inst.WORKER_TEMPLATE).read_text()
    assert "PrivateTmp=yes" in inst.render_unit(template, Path("/opt/venv"), Path("/opt/src"))
    assert "PrivateTmp=no" in inst.render_unit(template, Path("/tmp/ci/.venv"), Path("/tmp/ci"), private_tmp="no")
    assert inst.needs_host_tmp(Path("/tmp/ci-check/.venv"), Path("/opt/src"))
    assert inst.needs_host_tmp(Path("/var/tmp/venv"))
    assert not inst.needs_host_tmp(Path("/opt/venv"), Path("/srv/batchserve"))


# --- what the units say ---------------------------------------------------------------------------


def test_every_service_is_a_notify_unit_sharing_the_runtime_directory(units: dict) -> None:
    for name in SERVICES:
        unit = units[name]

        def get(key: str, unit: dict = unit) -> list[str]:
            return inst.unit_values(unit, "Service", key)

        assert get("Type") == ["notify"] and get("NotifyAccess") == ["main"], name
        assert get("EnvironmentFile") == ["/etc/batchserve/batchserve.env"], name
        # Shared by all five; without Preserve= stopping one unit would delete the others' sockets.
        assert get("RuntimeDirectory") == ["batchserve"] and get("RuntimeDirectoryPreserve") == ["yes"], name
        assert get("RuntimeDirectoryMode") == ["0700"], name  # the sockets are for the service user only
        assert get("CacheDirectory") == ["batchserve"] and get("StateDirectory") == ["batchserve"], name
        assert "BATCHSERVE_CACHE=%C/batchserve" in " ".join(get("Environment")), name
        assert get("User") == ["batchserve"] and get("DynamicUser") == [], name
        # A worker rank that rank 0 stopped (exit 0) must come back for the next group: always.
        restart = "always" if name.startswith("batchserve-worker@") else "on-failure"
        assert get("Restart") == [restart] and get("RestartPreventExitStatus") == ["2"], name
        assert get("StandardError") == ["journal"], name
        assert get("KillMode") == ["mixed"], name
        # Draining must finish before systemd escalates to SIGKILL.
        assert seconds(get("TimeoutStopSec")[0]) >= ServerConfig().drain_timeout_s + 10, name
        # ProtectHome=yes unless the venv, its interpreter or the source is under /home or /root.
        assert get("ProtectHome") == [inst.protect_home_for(Path(sys.prefix).absolute())], name
        for key, value in (
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("PrivateTmp", inst.private_tmp_for(Path(sys.prefix).absolute())),
            ("ProtectKernelTunables", "yes"),
            ("ProtectControlGroups", "yes"),
            ("CapabilityBoundingSet", ""),
        ):
            assert get(key) == [value], (name, key)
        families = get("RestrictAddressFamilies")[0].split()
        assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families), name
        assert inst.unit_values(unit, "Unit", "PartOf")[0] == "batchserve.target", name


def test_the_step_loops_are_watched(units: dict) -> None:
    """The worker's and scheduler's main loops send WATCHDOG=1; a loop stuck past WatchdogSec= is
    restarted. It must outlast a legitimately slow step (the step timeout)."""
    for name in SERVICES:
        watchdog = inst.unit_values(units[name], "Service", "WatchdogSec")
        if any(process in name for process in ("worker", "scheduler")):
            assert seconds(watchdog[0]) > ServerConfig().step_timeout_s, name
        else:
            assert watchdog == [], name


def test_worker_can_reach_the_gpu_and_others_cannot(units: dict) -> None:
    worker = units[WORKER]

    def get(key: str) -> list[str]:
        return inst.unit_values(worker, "Service", key)

    assert get("PrivateDevices") == ["no"] and get("DevicePolicy") == ["closed"]
    assert "char-nvidia* rw" in get("DeviceAllow") and "char-drm rw" in get("DeviceAllow")
    assert get("SupplementaryGroups") == ["video render"]
    assert get("MemoryDenyWriteExecute") == []  # CUDA/Triton JIT need writable+executable memory
    assert seconds(get("TimeoutStartSec")[0]) >= 15 * 60  # model loading/conversion, graph capture
    for name in SERVICES:
        if name != WORKER:
            assert inst.unit_values(units[name], "Service", "PrivateDevices") == ["yes"], name


def dependants(units: dict, name: str) -> set[str]:
    return {other for other in SERVICES if name in " ".join(inst.unit_values(units[other], "Unit", "Requires")).split()}


def test_a_dead_worker_restarts_everything_after_it(units: dict) -> None:
    # Requires= + PartOf= propagate stop and restart to dependants; After= orders them after the
    # unit they need (so they start only once it sent READY=1, and stop before it).
    for name in SERVICES:
        unit = units[name]
        requires = " ".join(inst.unit_values(unit, "Unit", "Requires")).split()
        after = " ".join(inst.unit_values(unit, "Unit", "After")).split()
        part_of = " ".join(inst.unit_values(unit, "Unit", "PartOf")).split()
        for needed in requires:
            assert needed in after and needed in part_of, (name, needed)
    reached, frontier = set(), {WORKER}
    while frontier:
        reached |= frontier
        frontier = set().union(*(dependants(units, n) for n in frontier)) - reached
    assert reached == set(SERVICES)
    assert inst.unit_values(units["batchserve-scheduler.service"], "Unit", "Requires") == [WORKER]


def test_target_pulls_in_every_service(units: dict) -> None:
    target = units["batchserve.target"]
    assert set(" ".join(inst.unit_values(target, "Unit", "Wants")).split()) == set(SERVICES)
    assert inst.unit_values(target, "Install", "WantedBy") == ["multi-user.target"]


def start_waves(units: dict, services: list[str]) -> list[list[str]]:
    """The services grouped as systemd may start them: each wave once everything its units are
    After= (or that is Before= them) has started."""
    after = {n: {a for a in words(units[n], "Unit", "After") if a in services} for n in services}
    for name in services:
        for later in words(units[name], "Unit", "Before"):
            if later in after:
                after[later].add(name)
    waves: list[list[str]] = []
    done: set[str] = set()
    while len(done) < len(services):
        ready = [n for n in services if n not in done and after[n] <= done]
        assert ready, f"ordering cycle among {set(services) - done}"
        waves.append(ready)
        done |= set(ready)
    return waves


def test_start_order_is_worker_first_api_last(units: dict) -> None:
    order = [name for wave in start_waves(units, SERVICES) for name in wave]
    assert order[0] == WORKER and order[-1] == "batchserve-api.service"
    assert [WORKER, *inst.SERVER_UNITS] == order


# --- tensor parallelism: the worker ranks' template ------------------------------------------------


def test_worker_template_runs_its_instance_as_the_local_rank() -> None:
    text = inst.render_unit((inst.TEMPLATE_DIR / inst.WORKER_TEMPLATE).read_text(), Path("/opt/venv"))
    template = inst.read_unit(text)
    exec_start = inst.unit_values(template, "Service", "ExecStart")
    assert exec_start == ["/opt/venv/bin/batchserve proc worker --local-rank %i"]
    assert inst.unit_values(template, "Service", "SyslogIdentifier") == ["batchserve-worker@%i"]
    assert not (inst.TEMPLATE_DIR / "batchserve-worker.service").exists()  # replaced by the template


def test_install_for_two_ranks(installed_two_ranks: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    prefix, result = installed_two_ranks
    workers = [inst.worker_unit(0), inst.worker_unit(1)]
    services = [*workers, *inst.SERVER_UNITS]
    assert sorted(p.name for p in (prefix / inst.UNIT_DIR).iterdir()) == sorted(inst.TEMPLATE_NAMES)
    units = load_units(prefix, [inst.TARGET, *services])
    target = units[inst.TARGET]
    assert words(target, "Unit", "Wants") == services and words(target, "Unit", "After") == services
    # The new env file carries the layout, so every unit (and the api's rank watch) reads tp=2.
    env = inst.read_env_file((prefix / inst.ENV_DIR / inst.ENV_FILE_NAME).read_text())
    assert env["BATCHSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    assert config_from_args(argparse.Namespace(), env=env).tensor_parallel_size == 2
    assert "worker ranks 0..1 of 2" in result.stdout
    # Global rank 0 stays the unit the scheduler needs; the other rank is ordered before the
    # scheduler too, so it starts before it and stops after it.
    assert words(units["batchserve-scheduler.service"], "Unit", "Requires") == [workers[0]]
    waves = start_waves(units, services)
    assert waves[0] == workers and waves[1] == ["batchserve-scheduler.service"]
    assert waves[-1] == ["batchserve-api.service"]


def test_worker_ranks_start_together_and_restart_as_a_set(
    installed_two_ranks: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    prefix, _ = installed_two_ranks
    workers = [inst.worker_unit(0), inst.worker_unit(1)]
    units = load_units(prefix, workers)
    for name in workers:
        unit = units[name]
        # They join each other while loading: an ordering between two ranks would deadlock the start.
        assert not set(words(unit, "Unit", "After")) & set(workers), name
        assert not set(words(unit, "Unit", "Before")) & set(workers), name
        # Each rank exits when the group breaks and comes back by itself (Restart=always: a rank that
        # rank 0 stopped exits 0); a rank that starts pulls in any rank not running (one stopped on
        # its own). No restart propagated between ranks: it would stop a rank while it joins.
        assert words(unit, "Unit", "PartOf") == [inst.TARGET], name
        assert words(unit, "Unit", "Wants") == workers, name
        assert "batchserve-scheduler.service" in words(unit, "Unit", "Before"), name

        def get(key: str, unit: dict = unit) -> list[str]:
            return inst.unit_values(unit, "Service", key)

        assert get("ExecStart")[0].endswith(f"proc worker --local-rank {name.split('@')[1].split('.')[0]}"), name
        assert get("Restart") == ["always"] and get("Type") == ["notify"], name
        # gloo and NCCL find the network interfaces over netlink; without it no rank can join.
        assert "AF_NETLINK" in get("RestrictAddressFamilies")[0].split(), name
        assert get("DeviceAllow") and get("PrivateDevices") == ["no"], name  # every rank owns a device


def test_install_on_a_machine_of_node_rank_1_has_only_its_worker_ranks(
    installed_node_1: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    prefix, result = installed_node_1
    workers = [inst.worker_unit(0), inst.worker_unit(1)]  # its local ranks: global ranks 2 and 3
    assert sorted(p.name for p in (prefix / inst.UNIT_DIR).iterdir()) == sorted([inst.TARGET, inst.WORKER_TEMPLATE])
    target = load_units(prefix, [inst.TARGET])[inst.TARGET]
    assert words(target, "Unit", "Wants") == workers and words(target, "Unit", "After") == workers
    env = inst.read_env_file((prefix / inst.ENV_DIR / inst.ENV_FILE_NAME).read_text())
    config = config_from_args(argparse.Namespace(), env=env)
    assert (config.tensor_parallel_size, config.nnodes, config.node_rank, config.dist_init_addr) == (
        4,
        2,
        1,
        "10.0.0.1:29500",
    )
    assert "node_rank 1 of 2" in result.stdout and "worker ranks 2..3 of 4" in result.stdout
    assert "10.0.0.1:29500" in result.stdout


def test_install_reads_the_layout_from_a_kept_env_file(tmp_path: Path) -> None:
    env_file = tmp_path / inst.ENV_DIR / inst.ENV_FILE_NAME
    env_file.parent.mkdir(parents=True)
    env_file.write_text("BATCHSERVE_TENSOR_PARALLEL_SIZE=3\n")
    result = run_install("--prefix", str(tmp_path))
    assert result.returncode == 0, result.stderr
    target = load_units(tmp_path, [inst.TARGET])[inst.TARGET]
    workers = [inst.worker_unit(i) for i in range(3)]
    assert words(target, "Unit", "Wants") == [*workers, *inst.SERVER_UNITS]
    assert env_file.read_text() == "BATCHSERVE_TENSOR_PARALLEL_SIZE=3\n"
    # A flag that disagrees with the kept file would install a layout the units do not run.
    result = run_install("--prefix", str(tmp_path), "--tp", "2")
    assert result.returncode == 2 and "BATCHSERVE_TENSOR_PARALLEL_SIZE=3 there" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    result = run_install("--prefix", str(tmp_path), "--tp", "2", "--force")
    assert result.returncode == 0, result.stderr
    assert "BATCHSERVE_TENSOR_PARALLEL_SIZE=2\n" in env_file.read_text()


def test_install_removes_units_this_machine_no_longer_runs(tmp_path: Path) -> None:
    unit_dir = tmp_path / inst.UNIT_DIR
    unit_dir.mkdir(parents=True)
    (unit_dir / "batchserve-worker.service").write_text("[Unit]\n")  # before the worker was a template
    assert run_install("--prefix", str(tmp_path), "--dry-run").returncode == 0
    assert (unit_dir / "batchserve-worker.service").exists()
    result = run_install("--prefix", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"remove   {unit_dir / 'batchserve-worker.service'}" in result.stdout
    assert sorted(p.name for p in unit_dir.iterdir()) == sorted(inst.TEMPLATE_NAMES)
    # The same machine made node_rank 1: the server's units go, its worker ranks stay.
    result = run_install("--prefix", str(tmp_path), "--force", *NODE_1)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in unit_dir.iterdir()) == sorted([inst.TARGET, inst.WORKER_TEMPLATE])


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--tp", "2", "--nnodes", "2", "--node-rank", "1"), "dist_init_addr HOST:PORT is required"),
        (("--tp", "3", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:29500"), "nnodes must be >= 1 and divide"),
        (
            ("--tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "10.0.0.1:29500"),
            "node_rank must be in",
        ),
        (("--tp", "2", "--dp", "2"), "data_parallel_size 2 with tensor_parallel_size 2 is not supported"),
    ],
)
def test_a_layout_that_cannot_run_is_refused(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    result = run_install("--prefix", str(tmp_path), *argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


# --- replicas: one set of units per replica ---------------------------------------------------------


@pytest.fixture(scope="module")
def installed_replicas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return install_layout(tmp_path_factory, "root-dp2", *TWO_REPLICAS)


def replica_services(replica: int) -> list[str]:
    return [inst.replica_unit(name, replica) for name in ("worker", *inst.SERVER_PROCESSES)]


def needs_smg_in_this_venv() -> None:
    if not (Path(sys.prefix) / "bin" / "smg").is_file():
        pytest.skip("smg is not installed in this venv (pip install -e '.[router]'): no router unit to install")


def test_install_for_two_replicas(installed_replicas: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    prefix, result = installed_replicas
    assert sorted(p.name for p in (prefix / inst.UNIT_DIR).iterdir()) == sorted(
        [inst.TARGET, inst.REPLICA_TARGET_TEMPLATE, inst.WORKER_TEMPLATE, *inst.REPLICA_TEMPLATES]
    )
    targets = [inst.replica_target(0), inst.replica_target(1)]
    units = load_units(prefix, [inst.TARGET, *targets, *REPLICA_SERVICES])
    assert words(units[inst.TARGET], "Unit", "Wants") == targets == words(units[inst.TARGET], "Unit", "After")
    for replica, target in enumerate(targets):
        mine = replica_services(replica)
        assert words(units[target], "Unit", "Wants") == mine == words(units[target], "Unit", "After")
        assert words(units[target], "Unit", "PartOf") == [inst.TARGET]
        for name in mine:
            unit = units[name]
            assert inst.unit_values(unit, "Service", "ExecStart")[0].endswith(f" --data-parallel-rank {replica}"), name
            assert inst.unit_values(unit, "Service", "SyslogIdentifier") == [name.removesuffix(".service")]
            assert words(unit, "Unit", "PartOf")[0] == target, name
            named = [
                u
                for key in ("Requires", "After", "Before", "Wants", "PartOf")
                for u in words(unit, "Unit", key)
                if u.startswith("batchserve")
            ]
            assert set(named) <= {*mine, target}, (name, named)  # nothing of another replica
        # Within a replica, what one server has: the start order, and a dead worker restarting the rest.
        assert start_waves(units, mine) == [[mine[0]], [mine[1]], [mine[2], mine[3]], [mine[4]]]
        assert words(units[mine[1]], "Unit", "Requires") == [mine[0]]
    env = inst.read_env_file((prefix / inst.ENV_DIR / inst.ENV_FILE_NAME).read_text())
    assert config_from_args(argparse.Namespace(), env=env).data_parallel_size == 2
    assert "runs 2 replica(s)" in result.stdout and "ports 8000..8001" in result.stdout


def test_install_with_a_router(tmp_path: Path) -> None:
    needs_smg_in_this_venv()
    result = run_install("--prefix", str(tmp_path), *TWO_REPLICAS, "--router", "smg")
    assert result.returncode == 0, result.stderr
    assert inst.ROUTER_UNIT in {p.name for p in (tmp_path / inst.UNIT_DIR).iterdir()}
    targets = [inst.replica_target(0), inst.replica_target(1)]
    units = load_units(tmp_path, [inst.TARGET, inst.ROUTER_UNIT])
    assert words(units[inst.TARGET], "Unit", "Wants") == [*targets, inst.ROUTER_UNIT]
    router = units[inst.ROUTER_UNIT]
    assert inst.unit_values(router, "Service", "ExecStart") == [f"{Path(sys.prefix).absolute()}/bin/batchserve router"]
    assert inst.unit_values(router, "Service", "Type") == ["notify"]
    # after the replicas, and not restarted with one of them (its health checks take a replica out)
    assert set(targets) <= set(words(router, "Unit", "After")) and set(targets) <= set(words(router, "Unit", "Wants"))
    assert inst.unit_values(router, "Unit", "Requires") == []
    assert "smg (cache_aware) on port 8000" in result.stdout and "ports 8001..8002" in result.stdout
    assert_verified(verify(tmp_path / inst.UNIT_DIR, [inst.TARGET, inst.ROUTER_UNIT, *targets]))


def test_the_router_and_the_replicas_apis_share_an_internal_key_no_one_else_reads(tmp_path: Path) -> None:
    """install-systemd makes the router's internal key once (0600; systemd reads it as root), for the
    router's unit and the replicas' api units alone; a reinstall keeps it; --dry-run does not show it."""
    needs_smg_in_this_venv()
    dry = run_install("--prefix", str(tmp_path), *TWO_REPLICAS, "--router", "smg", "--dry-run")
    key_file = tmp_path / inst.ENV_DIR / inst.INTERNAL_KEY_FILE_NAME
    assert dry.returncode == 0 and f"would write {key_file} (mode 600)\n(a new key, not shown)" in dry.stdout, (
        dry.stdout
    )
    assert f"{INTERNAL_KEY_ENV}=" not in dry.stdout
    assert run_install("--prefix", str(tmp_path), *TWO_REPLICAS, "--router", "smg").returncode == 0
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = inst.read_env_file(key_file.read_text())[INTERNAL_KEY_ENV]
    assert len(key) >= 40
    readers = {
        name
        for name in [inst.ROUTER_UNIT, *REPLICA_SERVICES]
        if f"/{inst.ENV_DIR / inst.INTERNAL_KEY_FILE_NAME}"
        in inst.unit_values(load_units(tmp_path, [name])[name], "Service", "EnvironmentFile")
    }
    assert readers == {inst.ROUTER_UNIT, inst.replica_unit("api", 0), inst.replica_unit("api", 1)}
    again = run_install("--prefix", str(tmp_path), "--force", *TWO_REPLICAS, "--router", "smg")
    assert again.returncode == 0 and f"keep     {key_file} (exists; the router's key" in again.stdout
    assert inst.read_env_file(key_file.read_text())[INTERNAL_KEY_ENV] == key


def test_replicas_without_a_router_have_no_internal_key(
    installed_replicas: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    prefix, _ = installed_replicas
    assert not (prefix / inst.ENV_DIR / inst.INTERNAL_KEY_FILE_NAME).exists()
    api = load_units(prefix, [inst.replica_unit("api", 0)])[inst.replica_unit("api", 0)]
    assert inst.unit_values(api, "Service", "EnvironmentFile") == ["/etc/batchserve/batchserve.env"]


def test_a_router_needs_smg_in_the_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "batchserve").write_text("")
    result = run_install("--prefix", str(tmp_path / "root"), "--venv", str(venv), "--router", "smg")
    assert result.returncode == 2 and "router smg: smg is not installed in" in result.stderr, result.stderr
    assert not (tmp_path / "root").exists()


def test_switching_to_replicas_and_back_replaces_the_units(tmp_path: Path) -> None:
    unit_dir = tmp_path / inst.UNIT_DIR
    assert run_install("--prefix", str(tmp_path)).returncode == 0
    result = run_install("--prefix", str(tmp_path), "--force", *TWO_REPLICAS)
    assert result.returncode == 0, result.stderr
    assert (
        f"remove   {unit_dir / 'batchserve-api.service'} (not run on this machine any more; "
        "`systemctl stop batchserve-api.service` if it runs)"
    ) in result.stdout
    assert sorted(p.name for p in unit_dir.iterdir()) == sorted(
        [inst.TARGET, inst.REPLICA_TARGET_TEMPLATE, inst.WORKER_TEMPLATE, *inst.REPLICA_TEMPLATES]
    )
    result = run_install("--prefix", str(tmp_path), "--force")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in unit_dir.iterdir()) == sorted(inst.TEMPLATE_NAMES)
    # A removed template's instances are stopped by a quoted glob (the template's own name stops none).
    assert (
        f"remove   {unit_dir / 'batchserve-api@.service'} (not run on this machine any more; "
        "`systemctl stop 'batchserve-api@*.service'` if it runs)"
    ) in result.stdout
    assert "`systemctl stop 'batchserve@*.target'` if it runs" in result.stdout


# --- systemd-analyze verify -----------------------------------------------------------------------


def verify(unit_dir: Path, names: list[str]) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd; .ci/run does this)")
    # An instance's path need not exist: verify loads it from the template in the same directory.
    return subprocess.run(
        [analyze, "verify", *(str(unit_dir / n) for n in names)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=unit_dir,
    )


def assert_verified(result: subprocess.CompletedProcess[str]) -> None:
    # Failure: a non-zero status, or any message about our units (unknown keys, bad values and
    # missing executables are reported as lines naming the unit). Lines about other units on the
    # host are not ours to judge. A missing User= is not checked by verify; it is created at install.
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "batchserve" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_systemd_analyze_verify_passes_on_rendered_units(installed: Path) -> None:
    assert_verified(verify(installed / inst.UNIT_DIR, [inst.TARGET, *SERVICES]))


def test_systemd_analyze_verify_passes_for_two_ranks_and_on_node_rank_1(
    installed_two_ranks: tuple[Path, subprocess.CompletedProcess[str]],
    installed_node_1: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    prefix, _ = installed_two_ranks
    assert_verified(
        verify(prefix / inst.UNIT_DIR, [inst.TARGET, inst.worker_unit(0), inst.worker_unit(1), *inst.SERVER_UNITS])
    )
    prefix, _ = installed_node_1
    assert_verified(verify(prefix / inst.UNIT_DIR, [inst.TARGET, inst.worker_unit(0), inst.worker_unit(1)]))


def test_systemd_analyze_verify_passes_for_replicas(
    installed_replicas: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    prefix, _ = installed_replicas
    assert_verified(
        verify(prefix / inst.UNIT_DIR, [inst.TARGET, inst.replica_target(0), inst.replica_target(1), *REPLICA_SERVICES])
    )


def test_systemd_analyze_verify_catches_a_broken_unit(installed: Path, tmp_path: Path) -> None:
    for name in inst.TEMPLATE_NAMES:
        shutil.copy(installed / inst.UNIT_DIR / name, tmp_path / name)
    for name in ("batchserve-api.service", inst.WORKER_TEMPLATE):
        unit = tmp_path / name
        unit.write_text(unit.read_text().replace(f"{Path(sys.prefix).absolute()}/bin/", "/nonexistent/bin/"))
    result = verify(tmp_path, ["batchserve-api.service"])
    assert result.returncode != 0 and "/nonexistent/bin/batchserve" in result.stderr
    result = verify(tmp_path, [inst.worker_unit(1)])  # checked through its template
    assert result.returncode != 0 and "batchserve-worker@1.service" in result.stderr
