"""The five processes started exactly as the installed units say, in the units' order, each gated on
its READY=1 (as `Type=notify` + `After=`/`Before=` make systemd do), serving one HTTP request, then
stopped with SIGTERM in the order systemd stops them, each exiting 0 within its `TimeoutStopSec=`;
with one worker and with two tensor-parallel ranks (two instances of `batchserve-worker@.service`,
the services being those the installed `batchserve.target` wants).

What stands in for systemd: a clean environment built from the unit's `Environment=` and its
`EnvironmentFile=` (the installed env file, edited as an operator would: a tiny model, a free
port, a small KV cache), `%C`/`%S` and `$RUNTIME_DIRECTORY`/`$CACHE_DIRECTORY`/`$STATE_DIRECTORY`
pointing into a temporary directory, and one AF_UNIX datagram `$NOTIFY_SOCKET` per process.
Not emulated: User=, sandboxing and the journal (stdout/stderr go to files instead).
"""

from __future__ import annotations

import calendar
import json
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchserve.procs import install_systemd as inst
from batchserve.shared.ports import free_port

pytest.importorskip("batchserve.procs.launch", reason="the process launcher (procs/launch.py) is not there yet")

STARTUP_LIMIT_S = 180.0  # this test's own cap on TimeoutStartSec= (30 min for the worker)
UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Unit:
    name: str
    fields: dict[str, list[tuple[str, str]]]
    instance: str = ""  # %i of a template's instance

    def get(self, section: str, key: str) -> list[str]:
        return inst.unit_values(self.fields, section, key)

    def seconds(self, key: str) -> float:
        value = self.get("Service", key)[0]
        for suffix, factor in (("min", 60), ("s", 1)):
            if value.endswith(suffix):
                return float(value[: -len(suffix)]) * factor
        return float(value)


def start_waves(units: dict[str, Unit]) -> list[list[Unit]]:
    """The services grouped as systemd starts them: a wave starts once every unit it is After= (or
    that is Before= it) is up (READY=1); units in one wave start together. systemd stops the waves
    in reverse."""
    after = {n: set(" ".join(u.get("Unit", "After")).split()) & set(units) for n, u in units.items()}
    for name, unit in units.items():
        for later in " ".join(unit.get("Unit", "Before")).split():
            if later in after:
                after[later].add(name)
    done: list[str] = []
    waves: list[list[Unit]] = []
    while len(done) < len(units):
        ready = sorted(n for n in units if n not in done and after[n] <= set(done))
        assert ready, "ordering cycle"
        waves.append([units[n] for n in ready])
        done += ready
    return waves


def expand_specifiers(value: str, dirs: dict[str, Path | str]) -> str:
    """The specifiers these units use: %C (cache root), %S (state root), %i (instance), %%."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "%" and i + 1 < len(value):
            spec = value[i + 1]
            out.append("%" if spec == "%" else str(dirs[spec]))
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


class NotifySocket:
    """What systemd listens on for one unit. With NotifyAccess=main it only believes messages whose
    sender (SCM_CREDENTIALS) is the main process, so that is checked here too."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.messages: list[tuple[str, int | None]] = []  # (text, sender pid)

    def recv(self, timeout_s: float) -> tuple[str, int | None] | None:
        self.sock.settimeout(timeout_s)
        try:
            data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
        except TimeoutError:
            return None
        pid = None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = UCRED.unpack(payload[: UCRED.size])[0]
        message = (data.decode(), pid)
        self.messages.append(message)
        return message

    def wait_ready(self, proc: subprocess.Popen, timeout_s: float) -> float:
        """Wall-clock time READY=1 arrived from `proc` itself; fails if it exits first or is late."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"exited with status {proc.returncode} before READY=1")
            got = self.recv(0.2)
            if got is not None and "READY=1" in got[0].split("\n"):
                assert got[1] == proc.pid, f"READY=1 sent by pid {got[1]}, not the main process {proc.pid}"
                return time.time()
        raise AssertionError(f"no READY=1 within {timeout_s:.0f}s")

    def close(self) -> None:
        self.sock.close()


class FakeSystemd:
    """The units installed under a temporary prefix, and the directories systemd would give them."""

    def __init__(self, root: Path, env_lines: dict[str, str], install_flags: tuple[str, ...] = ()) -> None:
        self.root = root
        self.prefix = root / "root"
        self.batchserve = Path(sys.prefix) / "bin" / "batchserve"
        installed = subprocess.run(
            [str(self.batchserve), "install-systemd", "--prefix", str(self.prefix), *install_flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert installed.returncode == 0, installed.stderr
        # The operator's edit of /etc/batchserve/batchserve.env.
        with (self.prefix / inst.ENV_DIR / inst.ENV_FILE_NAME).open("a") as f:
            f.write("".join(f"{key}={value}\n" for key, value in env_lines.items()))
        # What `systemctl start batchserve.target` starts: the services it wants, an instance
        # (batchserve-worker@1.service) loaded from its template.
        target = inst.read_unit((self.prefix / inst.UNIT_DIR / inst.TARGET).read_text())
        self.services = {n: self._load(n) for n in " ".join(inst.unit_values(target, "Unit", "Wants")).split()}
        self.dirs = {"C": root / "cache", "S": root / "state"}
        self.run_dir = root / "run" / "batchserve"
        self.journal = root / "journal"
        for d in (self.run_dir, self.dirs["C"] / "batchserve", self.dirs["S"] / "batchserve", self.journal):
            d.mkdir(parents=True)
        self._logs: list = []

    def _load(self, name: str) -> Unit:
        prefix, at, rest = name.partition("@")
        instance = rest.removesuffix(".service")
        path = self.prefix / inst.UNIT_DIR / (f"{prefix}@.service" if at else name)
        return Unit(name, inst.read_unit(path.read_text()), instance)

    def environment(self, unit: Unit, notify: NotifySocket) -> dict[str, str]:
        env = {"PATH": CLEAN_PATH, "LANG": "C.UTF-8"}
        for assignment in unit.get("Service", "Environment"):
            for item in shlex.split(assignment):
                key, _, value = item.partition("=")
                env[key] = expand_specifiers(value, self.dirs)
        for path in unit.get("Service", "EnvironmentFile"):  # overrides Environment=, as in systemd
            env.update(inst.read_env_file((self.prefix / path.lstrip("-/")).read_text()))
        env.update(
            RUNTIME_DIRECTORY=str(self.run_dir),
            CACHE_DIRECTORY=str(self.dirs["C"] / "batchserve"),
            STATE_DIRECTORY=str(self.dirs["S"] / "batchserve"),
            NOTIFY_SOCKET=str(notify.path),
        )
        return env

    def start(self, unit: Unit) -> tuple[subprocess.Popen, NotifySocket]:
        """ExecStart= with the unit's environment; stdout and stderr to the unit's 'journal' file."""
        notify = NotifySocket(self.root / f"{unit.name}.notify")
        argv = [
            expand_specifiers(arg, {**self.dirs, "i": unit.instance})
            for arg in shlex.split(unit.get("Service", "ExecStart")[0])
        ]
        assert argv[0] == str(self.batchserve) and os.access(argv[0], os.X_OK)
        log = (self.journal / f"{unit.name}.log").open("wb")
        self._logs.append(log)
        proc = subprocess.Popen(
            argv,
            env=self.environment(unit, notify),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/",
        )
        return proc, notify

    def log_of(self, unit: Unit) -> str:
        return (self.journal / f"{unit.name}.log").read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.journal.iterdir())
        )

    def close(self) -> None:
        for log in self._logs:
            log.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # ipc:// and AF_UNIX paths must stay under ~100 bytes: pytest's tmp_path can be too long.
    path = Path(tempfile.mkdtemp(prefix="bs-sd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tiny_settings(model: Path, **extra: object) -> dict[str, str]:
    settings = {"BATCHSERVE_MODEL": str(model), "BATCHSERVE_DEVICE": "cpu", "BATCHSERVE_KV_CAPACITY_TOKENS": "4096"}
    settings.update({key: str(value) for key, value in extra.items()})
    return settings


@pytest.mark.parametrize("tp", [1, 2])
def test_units_start_serve_and_stop_like_systemd(short_tmp: Path, tiny_model_dir: Callable[..., Path], tp: int) -> None:
    port = free_port()
    # Two ranks meet at a free port rather than the standalone default, which another test may hold.
    extra = {"BATCHSERVE_DIST_INIT_ADDR": f"127.0.0.1:{free_port()}"} if tp > 1 else {}
    host = FakeSystemd(
        short_tmp,
        tiny_settings(tiny_model_dir("llama", with_tokenizer=True), BATCHSERVE_PORT=port, **extra),
        install_flags=("--tp", str(tp)),
    )
    procs: dict[str, tuple[subprocess.Popen, NotifySocket]] = {}
    waves = start_waves(host.services)
    workers = [inst.worker_unit(rank) for rank in range(tp)]
    assert [[u.name for u in wave] for wave in waves] == [
        workers,
        ["batchserve-scheduler.service"],
        ["batchserve-detokenizer.service", "batchserve-tokenizer.service"],
        ["batchserve-api.service"],
    ]
    try:
        for wave in waves:  # a wave starts only once the previous one reported READY=1 (After= + Type=notify)
            spawned = time.time()
            for unit in wave:
                procs[unit.name] = host.start(unit)
            for unit in wave:
                proc, notify = procs[unit.name]
                try:
                    ready_at = notify.wait_ready(proc, min(unit.seconds("TimeoutStartSec"), STARTUP_LIMIT_S))
                except AssertionError as exc:
                    raise AssertionError(f"{unit.name}: {exc}\n{host.all_logs()}") from None
                print(f"{unit.name} (pid {proc.pid}): READY=1 {ready_at - spawned:.2f}s after start")

        # Every socket lives in the shared RuntimeDirectory.
        sockets = {p.name for p in host.run_dir.iterdir()}
        assert {"worker.sock", "scheduler.sock", "api.sock"} <= sockets, sockets

        base = f"http://127.0.0.1:{port}"
        asked = time.monotonic()
        wait_healthy(base, host)
        print(f"/health 200 {time.monotonic() - asked:.2f}s after the api's READY=1")
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
            model_id = json.load(response)["data"][0]["id"]
        request = urllib.request.Request(
            f"{base}/v1/completions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": model_id, "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0}).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            body = json.load(response)
        choice = body["choices"][0]
        assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")
        assert 1 <= body["usage"]["completion_tokens"] <= 4
        assert body["usage"]["prompt_tokens"] in (3, 4)  # with or without BOS
        for rank, name in enumerate(workers):  # each instance ran its own rank of the group
            loaded = [r for r in log_records(host.log_of(host.services[name])) if r.get("message") == "model loaded"]
            assert loaded, f"{name} logged no 'model loaded'\n{host.all_logs()}"
            expected = {"rank": rank} if rank else {"tensor_parallel_size": tp}  # a follower logs its rank
            assert expected.items() <= loaded[0].items(), loaded[0]

        # systemd stops the waves in reverse, each wave only after the previous one has exited.
        for wave in reversed(waves):
            started = time.monotonic()
            for unit in wave:
                proc, _ = procs[unit.name]
                assert proc.poll() is None, f"{unit.name} died while serving\n{host.all_logs()}"
                proc.send_signal(signal.SIGTERM)
            for unit in wave:
                proc, _ = procs[unit.name]
                limit = unit.seconds("TimeoutStopSec")
                try:
                    status = proc.wait(timeout=max(0.0, started + limit - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"{unit.name} still running {limit:.0f}s after SIGTERM\n{host.all_logs()}"
                    ) from None
                assert status == 0, f"{unit.name} exited {status} after SIGTERM\n{host.all_logs()}"
                print(
                    f"{unit.name} (pid {proc.pid}): exit 0 {time.monotonic() - started:.2f}s after SIGTERM "
                    f"(TimeoutStopSec={limit:.0f}s)"
                )
    finally:
        for proc, notify in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            notify.close()
        host.close()


def wait_healthy(base: str, host: FakeSystemd, timeout_s: float = 15.0) -> None:
    """Once the api is READY, /health turns 200 within a heartbeat or two."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise AssertionError(
        f"/health not 200 within {timeout_s:.0f}s after every unit was READY ({last})\n{host.all_logs()}"
    )


# --- readiness: the worker says READY=1 only once its model is loaded -----------------------------


def log_records(text: str) -> list[dict]:
    """The JSON lines of a process's stderr (BATCHSERVE_LOG_FORMAT=json, as the env file sets)."""
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def log_time(record: dict) -> float:
    """A record's 'time' (UTC, millisecond resolution, truncated) as a Unix timestamp."""
    parsed = time.strptime(record["time"][:19], "%Y-%m-%dT%H:%M:%S")
    return calendar.timegm(parsed) + int(record["time"][20:23]) / 1000


def test_worker_sends_ready_only_after_loading_its_model(short_tmp: Path, tiny_model_dir: Callable[..., Path]) -> None:
    import zmq

    from batchserve.shared.ipc import Endpoints, Receiver, SchedulerInbox
    from batchserve.shared.process_messages import WorkerInfo

    host = FakeSystemd(short_tmp, tiny_settings(tiny_model_dir("llama", with_tokenizer=True)))
    worker = host.services[inst.worker_unit(0)]
    ctx = zmq.Context()
    # Stand in for the scheduler: the worker announces what it loaded there (WorkerInfo).
    scheduler: Receiver[SchedulerInbox] = Receiver(ctx, Endpoints.in_dir(host.run_dir).scheduler, SchedulerInbox)
    spawned = time.time()
    proc, notify = host.start(worker)
    try:
        ready_at = notify.wait_ready(proc, STARTUP_LIMIT_S)
        records = log_records(host.log_of(worker))
        loaded = [r for r in records if r.get("message") == "model loaded"]
        assert loaded, f"no 'model loaded' log line before READY=1:\n{host.log_of(worker)}"
        # The load finished (log line stamped) no later than READY=1 arrived, and READY=1 came at
        # least as long after the start as the load itself took.
        assert log_time(loaded[0]) <= ready_at
        assert ready_at - spawned >= float(loaded[0]["seconds"])
        # What the worker announces comes from the loaded model (the tiny Llama: eos 2, 512 positions).
        deadline = time.monotonic() + 10
        info = None
        while info is None and time.monotonic() < deadline:
            message = scheduler.recv(0.5)
            info = message if isinstance(message, WorkerInfo) else None
        assert info is not None, "no WorkerInfo from a worker that said READY=1"
        assert info.eos_token_ids == [2] and info.max_context == 512 and info.kv_capacity_tokens > 0

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=worker.seconds("TimeoutStopSec")) == 0, host.log_of(worker)
        while notify.recv(0.2) is not None:
            pass
        assert any("STOPPING=1" in text.split("\n") for text, _ in notify.messages)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
        scheduler.close()
        ctx.destroy(linger=0)
        host.close()


def test_worker_that_cannot_load_its_model_never_sends_ready(
    short_tmp: Path, tiny_model_dir: Callable[..., Path]
) -> None:
    broken = short_tmp / "broken-model"
    shutil.copytree(tiny_model_dir("llama", with_tokenizer=True), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated weights
    host = FakeSystemd(short_tmp, tiny_settings(broken))
    worker = host.services[inst.worker_unit(0)]
    proc, notify = host.start(worker)
    try:
        status = proc.wait(timeout=STARTUP_LIMIT_S)
        while notify.recv(0.2) is not None:
            pass
        assert status != 0, host.log_of(worker)
        assert not any("READY=1" in text.split("\n") for text, _ in notify.messages), notify.messages
        print(f"broken model: worker exit status {status}; last log line: {host.log_of(worker).splitlines()[-1:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
        host.close()
