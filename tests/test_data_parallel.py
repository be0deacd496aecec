"""Data parallelism without a model: the replicas' layout (ports, sockets, devices, the cores' split),
the layouts refused with one line naming the setting, what `serve` starts, and the gateway's command
line against smg's own parser (where smg is installed). The replicas end to end, behind a real smg:
tests/test_data_parallel_router.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from procs import serve
from procs.router import SMG_LAUNCH, smg_args
from procs.runtime import resolve_runtime_dir
from procs.worker.parallel import join, rank_device
from shared.config import ROUTER_POLICIES, ServerConfig
from shared.parallel import (RankLayout, check_parallel_config, replica_dir, replica_port, replica_urls, replicated,
                             router_metrics_port)

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


@pytest.mark.parametrize("fields, message", [
    ({"data_parallel_size": 0}, "data_parallel_size must be >= 1, got 0"),
    ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank must be in [0, data_parallel_size=2)"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2}, "data_parallel_size 2 with tensor_parallel_size 2 is not "
                                                           "supported"),
    ({"data_parallel_size": 2, "port": 0}, "port 0 (any free port) cannot be used with data_parallel_size > 1"),
    ({"data_parallel_size": 4, "router": "smg", "port": 65532}, "would pass 65535"),
])
def test_a_replica_layout_that_cannot_run_is_refused(fields, message):
    with pytest.raises(ValueError) as info:
        check_parallel_config(ServerConfig(**fields))
    assert message in str(info.value)


def test_serve_refuses_a_bad_layout_in_one_line_before_starting_anything(tmp_path):
    result = subprocess.run([sys.executable, "-m", "procs.cli", "serve", "--dp", "2", "--tp", "2",
                             "--runtime-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "data_parallel_size 2 with tensor_parallel_size 2" in result.stderr
    assert not (tmp_path / "run").exists()
    result = subprocess.run([sys.executable, "-m", "procs.cli", "serve", "--router-policy", "fastest"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2 and "router_policy" in result.stderr, result.stderr


def test_serve_starts_each_replicas_five_processes_then_the_router():
    keys = [launch.key for launch in serve.launches(ROUTED)]
    assert keys == ["worker@0", "scheduler@0", "tokenizer@0", "detokenizer@0", "api@0",
                    "worker@1", "scheduler@1", "tokenizer@1", "detokenizer@1", "api@1"]
    assert [launch.key for launch in serve.launches(ServerConfig())] == [
        "worker", "scheduler", "tokenizer", "detokenizer", "api"]  # one server: named as before
    assert serve.listen_ports(ROUTED) == [8001, 8002, 8000, 8003]
    assert serve.listen_ports(TWO) == [8000, 8001]


def test_the_gateway_command_line():
    assert SMG_LAUNCH == (sys.executable, "-m", "procs.smg_launch")
    command = smg_args(ROUTED)
    at = command.index("--worker-urls")
    assert command[at + 1: at + 3] == replica_urls(ROUTED)
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
        assert (args.worker_urls, args.policy, args.port, args.host) == (replica_urls(ROUTED), policy, 8000, "127.0.0.1")
        assert args.health_check_endpoint == "/health" and args.disable_tokenizer_autoload
        assert args.prometheus_port == 8003 and args.log_level == "warn"
