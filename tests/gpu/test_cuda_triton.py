"""CUDA only (skipped elsewhere): the Triton kernels of the CUDA path (`kernels/triton/`, issue 69) on the GPU,
where the interpreter tests (tests/test_triton_*.py) cannot reach: bf16 arithmetic and graph capture.
- multi-LoRA: adapter rows through the Triton shrink / expand, decode graphs replayed, against the masked
  matmuls (`--triton-kernels off`) on the same GPU: greedy tokens agree (bf16 near-ties tolerated), base rows
  equal the base model's alone, and the kernels were launched.
- Gated DeltaNet through flash-linear-attention: logits close to the torch form's, decode graphs replayed.
- GGUF blocks (W4A16): a Q4_0 file kept in blocks on the GPU decodes as the file de-quantized at load."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy
from model_references import chunked_logits
from test_cuda_decode import cuda_runner, model_dir, random_adapter  # noqa: F401 (model_dir: a fixture)
from test_graph_runner import prompts_for

from batchserve.kernels import triton as triton_kernels
from batchserve.procs.worker.lora.step import load_lora_adapter
from batchserve.procs.worker.model_runner import ModelRunner

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
            load_lora_adapter(runner, index, name, str(folders[name]), max_rank=16)
        before = triton_kernels.LAUNCHES["lora"]
        outputs[setting] = generate_greedy(runner, prompts, 8, adapters=chosen, arrival_gap=1)
        base = generate_greedy(runner, prompts, 8, arrival_gap=1)
        assert all(o == b for o, b, c in zip(outputs[setting], base, chosen) if c == 0)  # base rows: no term
        assert runner.graph_runner.lora_steps > 0
        assert (triton_kernels.LAUNCHES["lora"] > before) == (setting == "on")
        del runner
    assert _agreement(outputs["on"], outputs["off"]) >= 0.9, outputs


def _hybrid_runner(folder, setting: str, graphs: bool) -> ModelRunner:
    return ModelRunner(
        folder,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        kv_capacity_tokens=2048,
        max_running_requests=8,
        triton_kernels=setting,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
    )


@pytest.mark.skipif(not triton_kernels.available(), reason="needs triton and fla-core (the gpu extra)")
def test_gated_delta_through_fla_agrees_with_the_torch_form_and_replays_in_graphs(tiny_model_dir):
    """A tiny Qwen3.5 in bf16: every position's logits of a 70-token prompt fed in chunks of 24 (fla's chunked
    form across its 64-token chunks, then its recurrent form) close to the torch form's on the same GPU; greedy
    tokens of decode graphs replayed equal the eager ones (the recurrent kernel captured)."""
    hybrid = tiny_model_dir("qwen3_5")
    prompt = (prompts_for(1, seed=9)[0] * 10)[:70]
    before = triton_kernels.LAUNCHES["gated_delta"]
    fla = chunked_logits(_hybrid_runner(hybrid, "on", graphs=False), prompt, chunk=24)
    assert triton_kernels.LAUNCHES["gated_delta"] > before
    torch_form = chunked_logits(_hybrid_runner(hybrid, "off", graphs=False), prompt, chunk=24)
    torch.testing.assert_close(fla, torch_form, atol=0.15, rtol=0.05)
    prompts = prompts_for(6, seed=2)
    eager = generate_greedy(_hybrid_runner(hybrid, "on", graphs=False), prompts, 8, arrival_gap=1)
    replayed = _hybrid_runner(hybrid, "on", graphs=True)
    assert generate_greedy(replayed, prompts, 8, arrival_gap=1) == eager
    assert replayed.graph_runner is not None and replayed.graph_runner.uses_cuda_graphs


@pytest.mark.skipif(not triton_kernels.available(), reason="needs triton and fla-core (the gpu extra)")
def test_a_q4_0_gguf_file_stays_in_blocks_on_the_gpu(tiny_model_dir, tmp_path, monkeypatch):
    """The W4A16 kernel on the GPU: a tiny Llama's Q4_0 file kept in its blocks (in GPU memory) greedy-decodes
    as the same file de-quantized at load (`--triton-kernels off`), bf16 near-ties tolerated."""
    from gguf_files import write_llama_gguf

    from batchserve.kernels.quant_blocks import BlockWeight
    from batchserve.shared.model import resolve_model

    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    source = tiny_model_dir("llama", with_tokenizer="bytes", hidden_size=256, intermediate_size=512)
    model = resolve_model(write_llama_gguf(source, tmp_path / "tiny.gguf", "Q4_0"))
    prompts = prompts_for(6, seed=6)
    outputs = {}
    for setting in ("on", "off"):
        runner = cuda_runner(model, "auto", graphs=True, triton_kernels=setting, quantization="none")
        down = runner.model.layers[0].mlp.down.weight
        assert isinstance(down, BlockWeight) == (setting == "on")
        if setting == "on":
            assert down.data.device.type == "cuda"
        outputs[setting] = generate_greedy(runner, prompts, 8, arrival_gap=1)
    assert _agreement(outputs["on"], outputs["off"]) >= 0.9, outputs
