"""The systemd units and env file: generated env file in sync with ServerConfig, install-systemd's
behaviour, dependency/readiness/draining settings, and `systemd-analyze verify` on rendered units."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from procs import install_systemd as inst
from shared.config import ServerConfig, config_from_args

SERVICES = [name for name in inst.UNIT_NAMES if name.endswith(".service")]


def run_install(*argv: str) -> subprocess.CompletedProcess[str]:
    batchserve = Path(sys.prefix) / "bin" / "batchserve"  # the console script, as a user runs it
    return subprocess.run([str(batchserve), "install-systemd", *argv],
                          capture_output=True, text=True, timeout=60, cwd=inst.SOURCE_DIR)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("root")
    result = run_install("--prefix", str(prefix))
    assert result.returncode == 0, result.stderr
    return prefix


@pytest.fixture(scope="module")
def units(installed: Path) -> dict[str, dict[str, list[tuple[str, str]]]]:
    return {name: inst.read_unit((installed / inst.UNIT_DIR / name).read_text()) for name in inst.UNIT_NAMES}


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
        "\"from procs.install_systemd import render_env_file; open('systemd/batchserve.env','w').write(render_env_file())\"")


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
    for name in inst.UNIT_NAMES:
        text = (installed / inst.UNIT_DIR / name).read_text()
        assert inst._PLACEHOLDER.search(text) is None, f"{name} still has a placeholder"
    exec_start = inst.unit_values(inst.read_unit((installed / inst.UNIT_DIR / "batchserve-api.service").read_text()),
                                  "Service", "ExecStart")
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
    assert (tmp_path / inst.UNIT_DIR / "batchserve-worker.service").is_file()
    result = run_install("--prefix", str(tmp_path), "--force")
    assert result.returncode == 0, result.stderr
    assert env_file.read_text() == inst.render_env_file()


def test_dry_run_prints_and_writes_nothing(tmp_path: Path) -> None:
    result = run_install("--prefix", str(tmp_path), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []
    for name in inst.UNIT_NAMES:
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
    template = (inst.TEMPLATE_DIR / "batchserve-worker.service").read_text()
    assert "PrivateTmp=yes" in inst.render_unit(template, Path("/opt/venv"), Path("/opt/src"))
    assert "PrivateTmp=no" in inst.render_unit(template, Path("/tmp/ci/.venv"), Path("/tmp/ci"), private_tmp="no")
    assert inst.needs_host_tmp(Path("/tmp/ci-check/.venv"), Path("/opt/src"))
    assert inst.needs_host_tmp(Path("/var/tmp/venv"))
    assert not inst.needs_host_tmp(Path("/opt/venv"), Path("/srv/batchserve"))


# --- what the units say ---------------------------------------------------------------------------

def test_every_service_is_a_notify_unit_sharing_the_runtime_directory(units: dict) -> None:
    for name in SERVICES:
        unit = units[name]
        get = lambda key: inst.unit_values(unit, "Service", key)  # noqa: E731
        assert get("Type") == ["notify"] and get("NotifyAccess") == ["main"], name
        assert get("EnvironmentFile") == ["/etc/batchserve/batchserve.env"], name
        # Shared by all five; without Preserve= stopping one unit would delete the others' sockets.
        assert get("RuntimeDirectory") == ["batchserve"] and get("RuntimeDirectoryPreserve") == ["yes"], name
        assert get("RuntimeDirectoryMode") == ["0700"], name  # the sockets are for the service user only
        assert get("CacheDirectory") == ["batchserve"] and get("StateDirectory") == ["batchserve"], name
        assert "BATCHSERVE_CACHE=%C/batchserve" in " ".join(get("Environment")), name
        assert get("User") == ["batchserve"] and get("DynamicUser") == [], name
        assert get("Restart") == ["on-failure"] and get("RestartPreventExitStatus") == ["2"], name
        assert get("StandardError") == ["journal"], name
        assert get("KillMode") == ["mixed"], name
        # Draining must finish before systemd escalates to SIGKILL.
        assert seconds(get("TimeoutStopSec")[0]) >= ServerConfig().drain_timeout_s + 10, name
        # ProtectHome=yes unless the venv, its interpreter or the source is under /home or /root.
        assert get("ProtectHome") == [inst.protect_home_for(Path(sys.prefix).absolute())], name
        for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                           ("PrivateTmp", inst.private_tmp_for(Path(sys.prefix).absolute())),
                           ("ProtectKernelTunables", "yes"),
                           ("ProtectControlGroups", "yes"), ("CapabilityBoundingSet", "")):
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
    worker = units["batchserve-worker.service"]
    get = lambda key: inst.unit_values(worker, "Service", key)  # noqa: E731
    assert get("PrivateDevices") == ["no"] and get("DevicePolicy") == ["closed"]
    assert "char-nvidia* rw" in get("DeviceAllow") and "char-drm rw" in get("DeviceAllow")
    assert get("SupplementaryGroups") == ["video render"]
    assert get("MemoryDenyWriteExecute") == []  # CUDA/Triton JIT need writable+executable memory
    assert seconds(get("TimeoutStartSec")[0]) >= 15 * 60  # model loading/conversion, graph capture
    for name in SERVICES:
        if name != "batchserve-worker.service":
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
    reached, frontier = set(), {"batchserve-worker.service"}
    while frontier:
        reached |= frontier
        frontier = set().union(*(dependants(units, n) for n in frontier)) - reached
    assert reached == set(SERVICES)
    assert inst.unit_values(units["batchserve-scheduler.service"], "Unit", "Requires") == ["batchserve-worker.service"]


def test_target_pulls_in_every_service(units: dict) -> None:
    target = units["batchserve.target"]
    assert set(" ".join(inst.unit_values(target, "Unit", "Wants")).split()) == set(SERVICES)
    assert inst.unit_values(target, "Install", "WantedBy") == ["multi-user.target"]


def start_order(units: dict) -> list[str]:
    """The services in an order systemd may start them: each after everything it is After=."""
    after = {n: {a for a in " ".join(inst.unit_values(units[n], "Unit", "After")).split() if a in SERVICES}
             for n in SERVICES}
    order: list[str] = []
    while len(order) < len(SERVICES):
        ready = [n for n in SERVICES if n not in order and after[n] <= set(order)]
        assert ready, f"ordering cycle among {set(SERVICES) - set(order)}"
        order += ready
    return order


def test_start_order_is_worker_first_api_last(units: dict) -> None:
    order = start_order(units)
    assert order[0] == "batchserve-worker.service" and order[-1] == "batchserve-api.service"
    assert [f"batchserve-{p}.service" for p in inst.START_ORDER] == order


# --- systemd-analyze verify -----------------------------------------------------------------------

def test_systemd_analyze_verify_passes_on_rendered_units(installed: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd; .ci/run does this)")
    unit_dir = installed / inst.UNIT_DIR
    result = subprocess.run([analyze, "verify", *(str(unit_dir / n) for n in inst.UNIT_NAMES)],
                            capture_output=True, text=True, timeout=120, cwd=unit_dir)
    # Failure: a non-zero status, or any message about our units (unknown keys, bad values and
    # missing executables are reported as lines naming the unit). Lines about other units on the
    # host are not ours to judge. A missing User= is not checked by verify; it is created at install.
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "batchserve" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_systemd_analyze_verify_catches_a_broken_unit(installed: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd; .ci/run does this)")
    for name in inst.UNIT_NAMES:
        shutil.copy(installed / inst.UNIT_DIR / name, tmp_path / name)
    api = tmp_path / "batchserve-api.service"
    api.write_text(api.read_text().replace(f"{Path(sys.prefix).absolute()}/bin/", "/nonexistent/bin/"))
    result = subprocess.run([analyze, "verify", str(api)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0 and "/nonexistent/bin/batchserve" in result.stderr
