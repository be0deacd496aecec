"""Data parallelism without a model: the replicas' layout (ports, sockets, devices, the cores' split),
the layouts refused with one line naming the setting, what `serve` starts, the gateway's command line
and keys against smg's own parser (where smg is installed), the replicas' acceptance of the router's
internal key, and a failed replica's processes retired at once by `serve` (stand-in processes). The
replicas end to end, behind a real smg: tests/test_data_parallel_router.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from batchserve.procs import serve
from batchserve.procs.api.auth import INTERNAL_KEY_ENV, accepted_keys
from batchserve.procs.router import SMG_LAUNCH, smg_args
from batchserve.procs.runtime import resolve_runtime_dir
from batchserve.procs.worker.parallel import join, rank_device
from batchserve.shared.commands import cli_command
from batchserve.shared.config import ROUTER_POLICIES, ServerConfig
from batchserve.shared.parallel import (
    RankLayout,
    check_parallel_config,
    replica_dir,
    replica_port,
    replica_urls,
    replicated,
    router_metrics_port,
)

REPO = Path(__file__).resolve().parent.parent
TWO = ServerConfig(port=8000, data_parallel_size=2)
ROUTED = ServerConfig(port=8000, data_parallel_size=2, router="smg")


def test_replicas_listen_on_the_ports_after_the_router():
    assert [replica_port(TWO, i) for i in range(2)] == [8000, 8001]
    assert [replica_port(ROUTED, i) for i in range(2)] == [8001, 8002] and router_metrics_port(ROUTED) == 8003
    assert replica_urls(ROUTED) == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert replica_urls(msgspec.structs.replace(ROUTED, host="::")) == ["http://[::1]:8001", "http://[::1]:8002"]
    assert replica_port(msgspec.structs.replace(ROUTED, data_parallel_rank=1)) == 8002  # a process's own
    one = ServerConfig(port=8000)
    assert replica_port(one) == 8000 and not replicated(one)  # one server: as before
    assert replicated(ServerConfig(router="smg"))  # one replica behind a router is a replica too


def test_each_replica_has_its_own_sockets(tmp_path):
    assert replica_dir(tmp_path, ServerConfig()) == tmp_path
    for rank in (0, 1):
        config = msgspec.structs.replace(TWO, data_parallel_rank=rank, runtime_dir=str(tmp_path))
        assert resolve_runtime_dir(config) == tmp_path / f"replica-{rank}"
        assert (tmp_path / f"replica-{rank}").stat().st_mode & 0o777 == 0o700


def test_a_replica_takes_its_own_device_or_share_of_the_cores():
    layout = RankLayout.of(msgspec.structs.replace(TWO, data_parallel_rank=1), 0)
    assert (layout.replica, layout.replicas, layout.picks_device, layout.cpu_shares) == (1, 2, True, 2)
    assert rank_device(torch.device("cuda"), layout) == torch.device("cuda", 1)
    assert rank_device(torch.device("cuda", 2), layout) == torch.device("cuda", 3)  # after --device's index
    assert rank_device(torch.device("cpu"), layout) == torch.device("cpu")
    alone = RankLayout.of(ServerConfig(), 0)
    assert not alone.picks_device and rank_device(torch.device("cuda"), alone) == torch.device("cuda")


def test_a_replica_worker_takes_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    config = msgspec.structs.replace(TWO, data_parallel_rank=1)
    try:
        tp = join(config, RankLayout.of(config, 0), torch.device("cpu"))
        assert tp.world_size == 1  # no group to join: a replica is one rank
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be >= 1, got 0"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank must be in [0, data_parallel_size=2)"),
        (
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            "data_parallel_size 2 with tensor_parallel_size 2 is not supported",
        ),
        ({"data_parallel_size": 2, "port": 0}, "port 0 (any free port) cannot be used with data_parallel_size > 1"),
        ({"data_parallel_size": 4, "router": "smg", "port": 65532}, "would pass 65535"),
    ],
)
def test_a_replica_layout_that_cannot_run_is_refused(fields, message):
    with pytest.raises(ValueError) as info:
        check_parallel_config(ServerConfig(**fields))
    assert message in str(info.value)


def test_serve_refuses_a_bad_layout_in_one_line_before_starting_anything(tmp_path):
    result = subprocess.run(
        [*cli_command("serve"), "--dp", "2", "--tp", "2", "--runtime-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "data_parallel_size 2 with tensor_parallel_size 2" in result.stderr
    assert not (tmp_path / "run").exists()
    result = subprocess.run(
        [*cli_command("serve"), "--router-policy", "fastest"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 2 and "router_policy" in result.stderr, result.stderr


def test_serve_starts_each_replicas_five_processes_then_the_router():
    keys = [launch.key for launch in serve.launches(ROUTED)]
    assert keys == [
        "worker@0",
        "scheduler@0",
        "tokenizer@0",
        "detokenizer@0",
        "api@0",
        "worker@1",
        "scheduler@1",
        "tokenizer@1",
        "detokenizer@1",
        "api@1",
    ]
    assert [launch.key for launch in serve.launches(ServerConfig())] == [
        "worker",
        "scheduler",
        "tokenizer",
        "detokenizer",
        "api",
    ]  # one server: named as before
    assert serve.listen_ports(ROUTED) == [8001, 8002, 8000, 8003]
    assert serve.listen_ports(TWO) == [8000, 8001]


def test_the_gateway_command_line():
    assert SMG_LAUNCH == (sys.executable, "-P", "-m", "batchserve.procs.smg_launch")
    command = smg_args(ROUTED)
    at = command.index("--worker-urls")
    assert command[at + 1 : at + 3] == replica_urls(ROUTED)
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert command[command.index("--health-check-endpoint") + 1] == "/health"
    assert command[command.index("--port") + 1] == "8000"
    assert command[command.index("--prometheus-port") + 1] == "8003"
    tuned = smg_args(msgspec.structs.replace(ROUTED, router_args="--balance-abs-threshold 8 --policy random"))
    assert tuned[-4:] == ["--balance-abs-threshold", "8", "--policy", "random"]  # last: they win


def test_smg_reads_the_gateway_command_line_and_knows_our_policies():
    """The contract with the pinned smg (1.13.0): its own parser takes what `smg_args` builds, and every
    --router-policy we offer is one of its policies."""
    launch_router = pytest.importorskip("smg.launch_router", reason="smg is not installed (pip install -e '.[router]')")
    from smg.router_args import COMMON_POLICY_CHOICES

    assert set(ROUTER_POLICIES) <= set(COMMON_POLICY_CHOICES)
    for policy in ("cache_aware", "round_robin"):
        args = launch_router.parse_router_args(smg_args(msgspec.structs.replace(ROUTED, router_policy=policy)))
        assert (args.worker_urls, args.policy, args.port, args.host) == (
            replica_urls(ROUTED),
            policy,
            8000,
            "127.0.0.1",
        )
        assert args.health_check_endpoint == "/health" and args.disable_tokenizer_autoload
        assert args.prometheus_port == 8003 and args.log_level == "warn"


def test_smg_gets_every_client_key_as_a_tenant_key_and_the_internal_key_for_its_control_plane():
    """procs/smg_launch.py against smg's own RouterArgs: no client key is smg's `--api-key` (which opens its
    control plane and which it presents to the replicas); the internal key is, and its control plane's."""
    smg_launch = pytest.importorskip(
        "batchserve.procs.smg_launch", reason="smg is not installed (pip install -e '.[router]')"
    )
    from smg.launch_router import parse_router_args

    args = parse_router_args(smg_args(ROUTED))
    smg_launch.apply_keys(args, "internal", ["k1", "k2", "k1"])
    assert args.api_key == "internal"
    assert args.tenant_api_keys == [("key1", "k1"), ("key2", "k2")]  # each key once: smg refuses duplicates
    assert args.control_plane_api_keys == [(smg_launch.CONTROL_KEY_ID, "batchserve router", "internal", "admin")]
    open_server = parse_router_args(smg_args(ROUTED))
    smg_launch.apply_keys(open_server, "internal", [])
    assert open_server.api_key is None and open_server.tenant_api_keys == []  # serving stays open, as the replicas
    assert [key for _, _, key, _ in open_server.control_plane_api_keys] == ["internal"]  # its control plane does not


def test_a_replicas_api_accepts_the_internal_key_beside_the_client_keys():
    with_keys = ServerConfig(api_key=["k1"])
    assert accepted_keys(with_keys, env={INTERNAL_KEY_ENV: "internal"}) == (b"k1", b"internal")
    assert accepted_keys(with_keys, env={}) == (b"k1",)
    assert accepted_keys(ServerConfig(), env={INTERNAL_KEY_ENV: "internal"}) == ()  # an open server stays open


STAND_IN = (
    "import os, sys, time\n"
    "open(f'/dev/shm/batchserve-{os.getpid()}-stand-in', 'w').close()\n"
    "print('up', flush=True)\n"
    "time.sleep(600)\n"
)


def stand_in(launch: serve.Launch) -> serve.Child:
    """A child of `serve` for `launch` that holds a shared-memory segment named by its pid, as ours do."""
    popen = subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE, start_new_session=True)
    assert popen.stdout is not None and popen.stdout.readline() == b"up\n"
    return serve.Child(launch.key, popen, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), launch, ready=True)


def test_a_failed_replica_is_cleaned_up_at_once_and_never_signalled_again(tmp_path, monkeypatch):
    """Once a replica's process died and `serve` stopped that replica, its processes' shared memory is gone
    at once and they leave `children`: the final stop signals only the live replica's process groups, and
    removes no segment by a retired pid (which may be another process's by then)."""
    supervisor = serve.Supervisor(
        msgspec.structs.replace(ROUTED, runtime_dir=str(tmp_path)), tmp_path, owns_runtime_dir=False
    )
    children = [stand_in(serve.Launch(name, name, replica=i)) for i in (0, 1) for name in ("worker", "api")]
    supervisor.children = {child.name: child for child in children}
    live, failed = children[:2], children[2:]
    try:
        os.kill(failed[0].pid, signal.SIGKILL)
        failed[0].popen.wait()
        assert supervisor._stop_failed_replicas()
        assert list(supervisor.children) == ["worker@0", "api@0"] and list(supervisor.retired) == ["worker@1", "api@1"]
        assert all(child.popen.poll() is not None for child in failed)
        assert not any(Path(f"/dev/shm/batchserve-{child.pid}-stand-in").exists() for child in failed)
        assert all(Path(f"/dev/shm/batchserve-{child.pid}-stand-in").exists() for child in live)

        reused = Path(f"/dev/shm/batchserve-{failed[0].pid}-another-process")  # as if its pid were taken again
        reused.touch()
        signalled: list[int] = []
        killpg = os.killpg
        monkeypatch.setattr(serve.os, "killpg", lambda pid, signum: (signalled.append(pid), killpg(pid, signum)))
        supervisor._stop_all()
        supervisor._cleanup()
        assert set(signalled) == {child.pid for child in live}
        assert reused.exists()
        assert not any(Path(f"/dev/shm/batchserve-{child.pid}-stand-in").exists() for child in live)
    finally:
        for child in children:
            if child.popen.poll() is None:
                child.popen.kill()
                child.popen.wait()
            child.popen.stdout.close()  # type: ignore[union-attr]
            for path in Path("/dev/shm").glob(f"batchserve-{child.pid}-*"):
                path.unlink()
