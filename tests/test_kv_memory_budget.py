"""KV pool sizing: an explicit capacity or GiB wins; on CUDA the pool takes `kv_memory_fraction` of the
device memory free after the weights (a faked `mem_get_info`); on the CPU 1 GiB."""

from __future__ import annotations

import pytest
import torch

from batchserve.procs.worker.kv_cache import (
    CPU_KV_MEMORY_GB,
    GIB,
    kv_bytes_per_token,
    kv_memory_budget_gb,
    num_pages_for,
)
from batchserve.shared.config import ServerConfig

CUDA = torch.device("cuda", 0)


def fake_mem_get_info(free_gib: float, total_gib: float = 141.0):
    calls = []

    def mem_get_info(device):
        calls.append(device)
        return int(free_gib * GIB), int(total_gib * GIB)

    return mem_get_info, calls


def test_cuda_pool_is_the_fraction_of_free_memory():
    mem_get_info, calls = fake_mem_get_info(139.5)
    assert kv_memory_budget_gb(CUDA, 0.0, 0.85, mem_get_info) == pytest.approx(0.85 * 139.5)
    assert calls == [CUDA]
    # SmolLM2-135M in bf16: 30 layers x 3 KV heads x 64 dims x K and V x 2 bytes = 23,040 bytes a token.
    per_token = kv_bytes_per_token(30, 3, 64, torch.bfloat16)
    assert per_token == 23040
    pages = num_pages_for(16, memory_gb=0.85 * 139.5, bytes_per_token=per_token)
    tokens = (pages - 1) * 16
    assert tokens == (int(0.85 * 139.5 * GIB) // (per_token * 16) - 1) * 16
    assert tokens // 8192 == 674  # whole 8k contexts at once: what the worker logs (5.5M tokens)


def test_explicit_sizes_win_and_the_cpu_keeps_its_default():
    mem_get_info, calls = fake_mem_get_info(10.0)
    assert kv_memory_budget_gb(CUDA, 2.5, 0.85, mem_get_info) == 2.5
    assert kv_memory_budget_gb(torch.device("cpu"), 0.0, 0.85, mem_get_info) == CPU_KV_MEMORY_GB
    assert calls == []  # nothing asked of the device when the size is given or there is none
    assert num_pages_for(16, capacity_tokens=1000, memory_gb=99.0) == 64  # the token capacity wins


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_out_of_range_is_refused(fraction):
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        kv_memory_budget_gb(CUDA, 0.0, fraction, fake_mem_get_info(10.0)[0])


def test_config_flags_reach_the_fields():
    import argparse

    from batchserve.shared.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(["--kv-memory-fraction", "0.7"]), env={})
    assert (config.kv_memory_fraction, config.kv_memory_gb) == (0.7, 0.0)
    assert ServerConfig().kv_memory_fraction == 0.85
