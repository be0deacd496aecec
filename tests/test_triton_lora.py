"""Multi-LoRA's Triton kernels (`kernels.triton.lora`, issue 69) on CPU tensors under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1): the grouped shrink / expand against a per-row torch loop (fp32
and fp16, adapters of two ranks and base rows in any order: base rows keep their values bit for bit), and a
tiny Llama with three PEFT adapters served through the CUDA path's code (`triton_kernels="on"`, the torch
attention backend, decode steps padded as CUDA graphs run them) greedy token-identical to PEFT, mixed with
base rows in one batch; the launch count shows the kernels ran (a silent fallback to torch fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_batches import generate_greedy
from test_lora_worker import ADAPTERS, NEW_TOKENS, _prompts, make_adapter, peft_greedy, runner_with_adapters
from test_model_equivalence import SCHEDULES, transformers_greedy

pytest.importorskip("triton")
pytest.importorskip("fla")

from batchserve.kernels import triton as triton_kernels  # noqa: E402
from batchserve.kernels.triton.lora import RowGroups, add_lora  # noqa: E402
from batchserve.procs.worker.lora.step import lora_of


def _reference(x, a, b, row_adapter, out):
    want = out.clone().float()
    for row, adapter in enumerate(row_adapter.tolist()):
        if adapter:
            want[row] += (x[row].float() @ a[adapter].float().T).to(x.dtype).float() @ b[adapter].float().T
    return want


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
def test_grouped_shrink_expand_equal_a_per_row_loop(dtype, tolerance):
    generator = torch.Generator().manual_seed(3)
    adapters, rank, k, n, rows = 4, 16, 72, 40, 37  # row count and widths off the blocks' multiples
    a = torch.randn(adapters, rank, k, generator=generator) / k**0.5
    b = torch.randn(adapters, n, rank, generator=generator) / rank**0.5
    a[2, 8:], b[2, :, 8:] = 0.0, 0.0  # adapter 2 of rank 8, zero-padded to the highest rank as the stacks are
    row_adapter = np.random.default_rng(3).integers(0, adapters, rows)
    row_adapter[:3] = 0
    x, out = torch.randn(rows, k, generator=generator), torch.randn(rows, n, generator=generator)
    x, out, a, b = (t.to(dtype) for t in (x, out, a, b))
    groups = RowGroups.of(row_adapter, adapters, torch.device("cpu"))
    got = add_lora(x, a, b, groups, out.clone())
    base = row_adapter == 0
    assert torch.equal(got[base], out[base])  # the base model's rows: untouched
    assert (got.float() - _reference(x, a, b, row_adapter, out)).abs().max() < tolerance


def test_groups_list_each_adapters_rows_in_order():
    groups = RowGroups.of(np.array([2, 0, 1, 2, 0]), 4, torch.device("cpu"))
    assert groups.order.tolist() == [1, 4, 2, 0, 3]
    assert groups.starts.tolist() == [0, 2, 3, 5, 5]


THREE = {**ADAPTERS, "c": dict(r=16, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj"])}


@pytest.fixture(scope="module")
def three_adapters(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama")
    folders = {
        name: make_adapter(base, tmp_path_factory.mktemp(f"lora-{name}"), seed, **config)
        for seed, (name, config) in enumerate(THREE.items())
    }
    prompts = _prompts()[:4]
    expected = {
        "base": transformers_greedy(base, prompts, NEW_TOKENS),
        **{name: peft_greedy(base, folder, prompts) for name, folder in folders.items()},
    }
    assert len({str(tokens) for tokens in expected.values()}) == 4  # each adapter matters
    return base, folders, prompts, expected


@pytest.mark.parametrize("pad_decode", [False, True])
def test_three_adapters_through_the_triton_kernels_equal_peft(three_adapters, triton_on, pad_decode):
    base, folders, prompts, expected = three_adapters
    runner = runner_with_adapters(base, folders, triton_kernels="on", attention_backend="torch", pad_decode=pad_decode)
    slots = lora_of(runner)
    assert slots is not None and slots.triton
    chosen = [1, 0, 3, 2]  # a, base, c, b
    names = ["base", "a", "b", "c"]
    before = triton_kernels.LAUNCHES["lora"]
    got = generate_greedy(runner, prompts, NEW_TOKENS, adapters=chosen, **SCHEDULES["mixed"])
    assert got == [expected[names[c]][i] for i, c in enumerate(chosen)]
    assert triton_kernels.LAUNCHES["lora"] > before  # the kernels ran: no silent fallback to the mask's matmuls
    if pad_decode:
        assert runner.graph_runner.lora_steps > 0
