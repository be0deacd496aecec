"""GGUF files served in their blocks (`shared.gguf_convert`, `procs.worker.gguf_tensors`,
`kernels.quant_blocks`): tiny Llama models written as GGUF files of each block type (and a Q4_K_M-like mix)
keep their 2-D weights in the file's blocks, and their greedy tokens are the de-quantized model's
(transformers reading the same file) wherever that model's top two logits are further apart than the
kernels' activation rounding can move them (each step teacher-forced)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from gguf import GGUFReader
from gguf_files import write_llama_gguf
from greedy_where_sure import assert_greedy_where_sure
from model_batches import generate_greedy

from batchserve.kernels import native
from batchserve.kernels.quant_blocks import BlockParts, BlockWeight
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.shared import gguf_convert
from batchserve.shared.gguf_convert import MANIFEST
from batchserve.shared.model import ModelLoadError, resolve_model

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the C kernels")

# weights of a trained model's scale (the tests' usual 0.2 makes a random model's logits swing on any rounding)
TINY = dict(
    arch="llama",
    with_tokenizer="bytes",
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    initializer_range=0.05,
)
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]
NEW_TOKENS = 8
# The activations' rounding to int8 (0.5-0.8 % of a layer's output) moves these models' logits (std ~0.8) by
# up to ~0.07 (measured); a step whose reference top two are closer than twice that may pick either.
MARGIN = 0.15


def q4_k_m(name: str) -> str:
    """llama-quantize's Q4_K_M choice, roughly: Q6_K for v, down and the embeddings, Q4_K elsewhere."""
    return "Q6_K" if any(part in name for part in ("attn_v", "ffn_down", "token_embd", "output.")) else "Q4_K"


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (37, 5, 50)]


def _reference(gguf) -> Any:
    """transformers' model of the file, de-quantized."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir(**TINY)


@pytest.mark.parametrize("block_type", [*TYPES, "Q4_K_M"])
def test_greedy_tokens_are_the_dequantized_models(block_type, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", q4_k_m if block_type == "Q4_K_M" else block_type)
    runner = ModelRunner(resolve_model(gguf), device="cpu", page_size=4, kv_capacity_tokens=1024, quantization="none")
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv.weight, BlockParts)  # q, k and v where the file has them (no copy)
    assert isinstance(layer.mlp.down.weight, BlockWeight) and isinstance(runner.model.embed.weight, BlockWeight)
    assert runner.model.fuse_decode_layers  # decode steps in the one C call, on the blocks
    assert_greedy_where_sure(runner, _reference(gguf), _prompts(), NEW_TOKENS, MARGIN)


def test_the_converted_folder_keeps_the_weights_in_the_file(tiny_llama, tmp_path, monkeypatch):
    """Only the norms are written out; the 2-D weights are read from the GGUF file where it lies."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0")
    converted = resolve_model(gguf)
    manifest = json.loads((converted / MANIFEST).read_text())
    assert manifest["files"] == [str(gguf.resolve())]
    q = manifest["tensors"]["model.layers.1.self_attn.q_proj.weight"]
    assert {k: q[k] for k in ("name", "heads", "type")} == {"name": "blk.1.attn_q.weight", "heads": 4, "type": "Q8_0"}
    [tensor] = [t for t in GGUFReader(str(gguf)).tensors if t.name == "blk.1.attn_q.weight"]
    assert (q["offset"], q["shape"]) == (tensor.data_offset, list(tensor.data.shape))  # read without parsing
    assert manifest["tensors"]["model.layers.1.self_attn.k_proj.weight"]["heads"] == 2
    assert (converted / "model.safetensors").stat().st_size < 16_000  # 5 norms of 256 floats


def test_a_split_model_is_read_from_its_shards(tiny_llama, tmp_path, monkeypatch):
    """gguf-split's shards (any of them named, or their folder): the tensors from every shard, the same logits
    as the one file's."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "whole").mkdir(), (tmp_path / "split").mkdir()
    whole = write_llama_gguf(tiny_llama, tmp_path / "whole" / "tiny.gguf", "Q4_K")
    first = write_llama_gguf(tiny_llama, tmp_path / "split" / "tiny.gguf", "Q4_K", shard_tensors=8)
    shards = sorted(first.parent.glob("*.gguf"))
    assert len(shards) > 2 and first == shards[0] and first.name.endswith(f"-00001-of-{len(shards):05d}.gguf")
    converted = resolve_model(shards[-1])
    assert resolve_model(first.parent) == converted  # the folder of one model's shards
    manifest = json.loads((converted / MANIFEST).read_text())
    assert manifest["files"] == [str(s.resolve()) for s in shards]
    assert {entry["file"] for entry in manifest["tensors"].values()} == set(range(len(shards)))
    greedy = [
        generate_greedy(
            ModelRunner(resolve_model(path), device="cpu", page_size=4, kv_capacity_tokens=1024, quantization="none"),
            _prompts(),
            NEW_TOKENS,
        )
        for path in (whole, first)
    ]
    assert greedy[0] == greedy[1]
    shards[1].unlink()
    with pytest.raises(ModelLoadError, match=rf"one of {len(shards)} shards; missing beside it: {shards[1].name}"):
        resolve_model(first)


def test_a_file_whose_fp32_tensors_would_not_fit_is_refused_saying_the_size(tiny_llama, tmp_path, monkeypatch):
    """What stays in blocks needs no memory of its own; what is de-quantized must fit what is free."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_convert, "available_bytes", lambda: 100_000)  # the norms' 5 KB fit, fp32 weights don't
    resolve_model(write_llama_gguf(tiny_llama, tmp_path / "q8.gguf", "Q8_0"))
    with pytest.raises(ModelLoadError, match=r"f32\.gguf: its F32 tensors de-quantize to 0\.0 GB of fp32, more than"):
        resolve_model(write_llama_gguf(tiny_llama, tmp_path / "f32.gguf", "F32"))


def test_a_gguf_file_gone_after_conversion_is_named(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0")
    converted = resolve_model(gguf)
    gguf.rename(tmp_path / "moved.gguf")
    with pytest.raises(ModelLoadError, match=r"reads its weights from .*tiny\.gguf, which is gone: delete"):
        ModelRunner(converted, device="cpu", page_size=4, kv_capacity_tokens=1024, quantization="none")


def test_tensor_parallel_ranks_split_the_blocks_and_give_tp1s_logits(tiny_llama, tmp_path, monkeypatch):
    """Two ranks: column layers take their rows of blocks, row layers their columns on block boundaries
    (each rank rounds its blocks of the input as one rank does), summed by the all-reduce."""
    from test_tensor_parallel import ENGINE, step_batches, step_logits

    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig

    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    converted = resolve_model(write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0"))
    tp2 = OfflineEngine(ServerConfig(model=str(converted), tensor_parallel_size=2, quantization="none", **ENGINE))
    try:
        with tp2.direct_runner() as runner:
            o = runner.model.layers[0].o.weight
            assert isinstance(o, BlockWeight) and (o.out_features, o.in_features) == (256, 128)
            got = step_logits(runner, step_batches(runner.vocab_size, runner.page_size))
    finally:
        tp2.close()
    tp1 = ModelRunner(
        converted, device="cpu", page_size=ENGINE["page_size"], kv_capacity_tokens=512, quantization="none"
    )
    want = step_logits(tp1, step_batches(tp1.vocab_size, tp1.page_size))
    # the ranks' partial sums round differently from one rank's sum (~1e-7), which may move an activation
    # across an int16 rounding step (1/32767 of its block's largest) in the next layer: up to ~2e-4 measured
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-3


def test_auto_keeps_the_blocks(tiny_llama, tmp_path, monkeypatch):
    """--quantization auto (the default) serves a file in its blocks, small or large: since prefill chunks run on
    de-quantized tiles, the blocks prefill at ~0.9x the fp32 panels' speed and decode one stream 2-3x faster
    (loadtests/results/gguf_blocks_cpu.txt) in a fifth to a seventh of the memory."""
    monkeypatch.setenv("BATCHSERVE_CACHE", str(tmp_path / "cache"))
    converted = resolve_model(write_llama_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q4_0"))
    runner = ModelRunner(converted, device="cpu", page_size=4, kv_capacity_tokens=256)
    assert isinstance(runner.model.layers[0].qkv.weight, BlockParts)
