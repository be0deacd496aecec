"""Weights kept in GGUF blocks on the Triton path (`kernels.triton.blocks`, issue 67's CUDA side, checked as
issue 69 does): W4A16 over Q4_0 / Q4_1 blocks and W8A16 over Q8_0 under Triton's interpreter, against the
de-quantized matmul (fp32 and fp16 activations; row counts and widths off the tiles, strided rows); tiny
Llamas served from GGUF files of those types and from an AWQ folder through the CUDA path's code
(`triton_kernels="on"`, the torch attention backend) keep the blocks (the k-quants are de-quantized at load
there) and greedy-decode the de-quantized model's tokens until its top two logits come close; the launch
count shows the kernels ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize
from gguf_files import write_llama_gguf
from greedy_where_sure import reference_greedy
from model_batches import generate_greedy
from test_gguf_blocks import NEW_TOKENS, TINY, _prompts, _reference
from test_hf_quantized import FORMATS, twins  # noqa: F401 (twins: a fixture)

pytest.importorskip("triton")
pytest.importorskip("fla")

from batchserve.kernels import triton as triton_kernels  # noqa: E402
from batchserve.kernels.quant_blocks import BLOCK_TYPES, BlockParts, BlockWeight  # noqa: E402
from batchserve.kernels.triton.blocks import block_matmul  # noqa: E402
from batchserve.procs.worker.model_runner import ModelRunner  # noqa: E402
from batchserve.shared.model import resolve_model  # noqa: E402

# fp32 activations against the fp32 de-quantized model: only the summation order differs
MARGIN = 0.01


def _blocks(w: torch.Tensor, kind: str) -> BlockWeight:
    data = quantize(w.numpy(), GGMLQuantizationType[kind])
    return BlockWeight(torch.from_numpy(np.ascontiguousarray(data)), BLOCK_TYPES[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_block_matmul_equals_the_dequantized_matmul(kind, dtype, tolerance):
    generator = torch.Generator().manual_seed(1)
    weight = _blocks(torch.randn(70, 160, generator=generator) * 0.1, kind)
    wide = torch.randn(19, 200, generator=generator)
    x = wide[:, 20:180]  # strided rows
    bias = torch.randn(70, generator=generator)
    reference = x @ weight.dequantize().T + bias
    got = block_matmul(x.to(dtype), weight, bias.to(dtype))
    assert got.dtype == dtype
    assert ((got.float() - reference).abs().max() / reference.abs().max()) < tolerance


def _assert_greedy_until_unsure(runner, reference, prompts: list[list[int]], new_tokens: int) -> None:
    """The runner's free-running greedy tokens equal the reference's up to its first step whose top two logits
    are within MARGIN (after it, either may follow), and at least half of them are that sure."""
    got = generate_greedy(runner, prompts, new_tokens, chunk=16, arrival_gap=1)
    sure = 0
    for ours, (theirs, margins) in zip(got, reference_greedy(reference, prompts, new_tokens)):
        length = next((i for i, m in enumerate(margins) if m <= MARGIN), new_tokens)
        assert ours[:length] == theirs[:length]
        sure += length
    assert sure >= len(prompts) * new_tokens // 2


def _triton_runner(model_dir, **kwargs) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        page_size=4,
        kv_capacity_tokens=1024,
        triton_kernels="on",
        attention_backend="torch",
        **kwargs,
    )


def _mixed(name: str) -> str:
    """Each kind the kernel reads in one file: Q8_0 for v and down (as llama-quantize's higher-precision picks),
    Q4_1 for the embeddings and q, Q4_0 elsewhere."""
    if any(part in name for part in ("attn_v", "ffn_down")):
        return "Q8_0"
    return "Q4_1" if any(part in name for part in ("token_embd", "attn_q")) else "Q4_0"


@pytest.mark.parametrize("block_type", [_mixed, "Q4_K"])
def test_a_gguf_file_keeps_its_blocks_on_the_triton_path(block_type, tiny_model_dir, tmp_path, monkeypatch, triton_on):
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tiny_model_dir(**TINY), tmp_path / "tiny.gguf", block_type)
    runner = _triton_runner(resolve_model(gguf))
    layer = runner.model.layers[0]
    kept = block_type != "Q4_K"  # the k-quants (blocks of 256) are de-quantized at load on this path
    assert isinstance(layer.qkv.weight, BlockParts) == kept and isinstance(layer.mlp.down.weight, BlockWeight) == kept
    if kept:
        assert [p.kind.name for p in layer.qkv.weight.parts] == ["Q4_1", "Q4_0", "Q8_0"]
    before = triton_kernels.LAUNCHES["blocks"]
    _assert_greedy_until_unsure(runner, _reference(gguf), _prompts()[:2], NEW_TOKENS // 2)
    assert (triton_kernels.LAUNCHES["blocks"] > before) == kept


@pytest.mark.parametrize("fmt", ["gptq-sym-v1", "fp8-block", "ct-fp8-channel"])
def test_gptq_and_fp8_folders_stay_in_blocks_on_the_triton_path(fmt, twins, triton_on):  # noqa: F811
    """Their repacked blocks (test_hf_quantized checks their values) are kept for the kernel, not de-quantized."""
    layer = _triton_runner(twins(fmt).quantized).model.layers[0]
    assert {p.kind.name for p in layer.qkv.weight.parts} == {FORMATS[fmt][2]}
    assert isinstance(layer.mlp.down.weight, BlockWeight)


def test_an_awq_folder_runs_its_int4_blocks_through_the_triton_kernel(twins, triton_on):  # noqa: F811
    from transformers import AutoModelForCausalLM

    folders = twins("awq-g128")
    runner = _triton_runner(folders.quantized)
    assert {p.kind.name for p in runner.model.layers[0].qkv.weight.parts} == {"Q4_1"}
    reference = AutoModelForCausalLM.from_pretrained(folders.plain, dtype=torch.float32).eval()
    before = triton_kernels.LAUNCHES["blocks"]
    _assert_greedy_until_unsure(runner, reference, _prompts()[1:2], NEW_TOKENS // 2)
    assert triton_kernels.LAUNCHES["blocks"] > before
