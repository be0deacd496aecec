"""`--quantization q8_0 | q4_0 | q4_k` (`kernels.block_quantize`): an fp32 checkpoint quantized at load into GGUF
blocks, as llama-quantize chooses them (Q5_0 for a layer not whole 256-value blocks wide under q4_k, the LM head
in Q6_K under the 4-bit choices), and served by the block kernels: its greedy tokens are those of transformers
running the same blocks de-quantized, wherever that model's top two logits are further apart than the kernels'
activation rounding can move them (each step teacher-forced)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from greedy_where_sure import assert_greedy_where_sure
from model_batches import generate_greedy
from test_gguf_blocks import MARGIN
from test_gguf_blocks import TINY as GGUF_TINY

from batchserve.kernels import native
from batchserve.kernels.block_quantize import block_type_for, quantize_weight
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.weight_bytes import weight_bytes

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the C kernels")

# intermediate 544: the down projection's rows are 17 blocks of 32, not whole 256-blocks (Q4_K's)
TINY = {**GGUF_TINY, "intermediate_size": 544}
NEW_TOKENS = 8
EXPECTED = {  # quantization -> (attention's type, the down projection's, the LM head's)
    "q8_0": ("Q8_0", "Q8_0", "Q8_0"),
    "q4_0": ("Q4_0", "Q4_0", "Q6_K"),
    "q4_k": ("Q4_K", "Q5_0", "Q6_K"),
}


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir(**TINY)


def _reference(model_dir, quantization: str) -> Any:
    """transformers' model with every linear layer's weight replaced by its blocks de-quantized (the LM head its
    own copy, where it is tied to the embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            blocks = quantize_weight(module.weight.detach(), quantization, head=name == "lm_head")
            module.weight = torch.nn.Parameter(blocks.dequantize(), requires_grad=False)
    return model


@pytest.mark.parametrize("quantization", sorted(EXPECTED))
def test_greedy_tokens_are_the_dequantized_blocks(quantization, tiny_llama):
    runner = ModelRunner(tiny_llama, device="cpu", page_size=4, kv_capacity_tokens=1024, quantization=quantization)
    layer, head = runner.model.layers[0], runner.model.lm_head.weight
    qkv = layer.qkv.weight
    assert isinstance(qkv, BlockParts) and len({p.kind for p in qkv.parts}) == 1
    weights = (qkv.parts[0], layer.mlp.down.weight, head)
    assert all(isinstance(w, BlockWeight) for w in weights)
    assert tuple(w.kind.name for w in weights) == EXPECTED[quantization]
    assert runner.model.fuse_decode_layers
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (37, 5, 60)]
    assert_greedy_where_sure(runner, _reference(tiny_llama, quantization), prompts, NEW_TOKENS, MARGIN, chunk=64)


def test_the_blocks_are_gguf_pys_and_round_trip_within_the_types_error():
    """Q8_0 / Q4_0 through gguf-py's own quantizer (the same bytes); every type's round trip on Gaussian
    weights within its rms error (measured: Q8_0 0.54 %, Q4_0 8.6 %, Q4_K 7.8 %, Q6_K 1.9 % of their std)."""
    from gguf import GGMLQuantizationType, quants

    w = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32))
    q8 = quantize_weight(w, "q8_0")
    assert np.array_equal(q8.data.numpy(), quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    bounds = {("q8_0", False): 0.006, ("q4_0", False): 0.095, ("q4_k", False): 0.085, ("q4_k", True): 0.021}
    for (quantization, head), bound in bounds.items():
        error = (quantize_weight(w, quantization, head=head).dequantize() - w).pow(2).mean().sqrt().item()
        assert error < bound, (quantization, head, error)


def test_a_layer_not_whole_blocks_wide_is_refused_naming_the_width():
    assert block_type_for("q4_k", 544).name == "Q5_0" and block_type_for("q4_k", 512, head=True).name == "Q6_K"
    with pytest.raises(ValueError, match=r"--quantization q8_0: a layer 100 inputs wide is not whole 32-value"):
        block_type_for("q8_0", 100)


def test_the_weight_bytes_are_the_blocks(tiny_llama):
    """What /metrics reports (`batchserve_model_weight_bytes`): q4_k's layers take ~1/7 of fp32's bytes."""
    runners = {
        q: ModelRunner(tiny_llama, device="cpu", page_size=4, kv_capacity_tokens=4096, quantization=q)
        for q in ("none", "q4_k")
    }
    sizes = {q: runner.worker_info().weight_bytes for q, runner in runners.items()}
    assert sizes["q4_k"] == weight_bytes(runners["q4_k"].model)
    generate_greedy(runners["q4_k"], [[5, 6, 7]], 2)  # steps leave views of the KV pool on the model: not weights
    assert runners["q4_k"].worker_info().weight_bytes == sizes["q4_k"]
    linear = sum(p.numel() for n, p in _linear_weights(tiny_llama))
    assert sizes["none"] - sizes["q4_k"] > linear * 4 * 0.8, (sizes, linear)


def _linear_weights(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
