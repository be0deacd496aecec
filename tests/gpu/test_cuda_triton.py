"""CUDA only (skipped elsewhere): the Triton kernels of the CUDA path (`kernels/triton/`, issue 69) on the GPU,
where the interpreter tests (tests/test_triton_*.py) cannot reach: bf16 arithmetic and graph capture.
- multi-LoRA: adapter rows through the Triton shrink / expand, decode graphs replayed, against the masked
  matmuls (`--triton-kernels off`) on the same GPU: greedy tokens agree (bf16 near-ties tolerated), base rows
  equal the base model's alone, and the kernels were launched."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy
from test_cuda_decode import cuda_runner, model_dir, random_adapter  # noqa: F401 (model_dir: a fixture)
from test_graph_runner import prompts_for

from batchserve.kernels import triton as triton_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.skipif(not triton_kernels.available(), reason="needs triton and fla-core (the gpu extra)")
def test_lora_triton_kernels_agree_with_the_masked_matmuls_under_graphs(model_dir, tmp_path):  # noqa: F811
    folders = {name: random_adapter(tmp_path / name, model_dir, seed) for seed, name in enumerate("abc")}
    prompts = prompts_for(8, seed=5)
    chosen = [1, 0, 2, 3, 1, 0, 3, 2]
    outputs = {}
    for setting in ("on", "off"):
        runner = cuda_runner(model_dir, "auto", graphs=True, triton_kernels=setting)
        for index, name in enumerate("abc", 1):
            runner.load_lora_adapter(index, name, str(folders[name]), max_rank=16)
        before = triton_kernels.LAUNCHES["lora"]
        outputs[setting] = generate_greedy(runner, prompts, 8, adapters=chosen, arrival_gap=1)
        base = generate_greedy(runner, prompts, 8, arrival_gap=1)
        assert all(o == b for o, b, c in zip(outputs[setting], base, chosen) if c == 0)  # base rows: no term
        assert runner.graph_runner.lora_steps > 0
        assert (triton_kernels.LAUNCHES["lora"] > before) == (setting == "on")
        del runner
    assert _agreement(outputs["on"], outputs["off"]) >= 0.9, outputs
