"""CUDA only (skipped elsewhere): the attention and position variants on the GPU, on tiny random models of
head_dim 64 (flashinfer's sizes): Gemma 2 (soft-capped scores and logits, a window of 8), Gemma 3 (q/k
norms, its sliding layers' own rope) and gpt-oss (attention sinks, yarn, a window, biased experts with a
clamped SwiGLU on torch._grouped_mm, which CUDA runs at bfloat16), the sliding layers in rings and not.
- fp32, torch backend: greedy tokens equal transformers' (Gemma; the experts need bfloat16 on CUDA);
- bfloat16: every position's logits of a prompt fed in chunks on flashinfer (its sinks by return_lse, a
  window per wrapper, rings through their own page lists) close to the torch backend's on the same GPU."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy
from model_references import RING_STEP_TOKENS, chunked_logits
from test_model_equivalence import transformers_greedy

from batchserve.procs.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
)
MODELS = {
    "gemma2": dict(arch="gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=2.0, **SHAPE),
    "gemma3": dict(arch="gemma3", **SHAPE),
    "gpt_oss": dict(
        arch="gpt_oss",
        swiglu_limit=1.0,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        },
        **SHAPE,
    ),
}
NEW_TOKENS = 16


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (25, 4, 13, 40)]


def cuda_runner(model_dir, dtype: str, backend: str, rings: bool) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cuda",
        dtype=dtype,
        page_size=16,
        kv_capacity_tokens=2048,
        max_running_requests=8,
        attention_backend=backend,
        ring_step_tokens=RING_STEP_TOKENS if rings else 0,
    )


@pytest.mark.parametrize("rings", [False, True])
@pytest.mark.parametrize("model", ["gemma2", "gemma3"])
def test_fp32_greedy_matches_transformers(tiny_model_dir, model, rings):
    model_dir = tiny_model_dir(**MODELS[model])
    expected = transformers_greedy(model_dir, _prompts(), NEW_TOKENS)
    runner = cuda_runner(model_dir, "float32", "torch", rings)
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, chunk=8, arrival_gap=2) == expected


@pytest.mark.parametrize("rings", [False, True])
@pytest.mark.parametrize("model", list(MODELS))
def test_flashinfer_logits_match_the_torch_backend(tiny_model_dir, model, rings):
    pytest.importorskip("flashinfer")
    model_dir = tiny_model_dir(**MODELS[model])
    prompt = _prompts()[3]
    reference = chunked_logits(cuda_runner(model_dir, "bfloat16", "torch", rings), prompt, chunk=7)
    got = chunked_logits(cuda_runner(model_dir, "bfloat16", "flashinfer", rings), prompt, chunk=7)
    torch.testing.assert_close(got, reference, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_fp32_greedy_matches_transformers_on_cuda(tiny_model_dir, model):
    """Gated DeltaNet layers (the torch form: chunked for chunks, recurrent for decode rows, the states in the
    pool on the GPU) beside full attention, with decode graphs captured (the rows' slots are a fixed buffer)."""
    model_dir = tiny_model_dir(model)
    expected = transformers_greedy(model_dir, _prompts(), NEW_TOKENS)
    runner = ModelRunner(
        model_dir,
        device="cuda",
        dtype="float32",
        page_size=16,
        kv_capacity_tokens=2048,
        max_running_requests=8,
        attention_backend="torch",
        cuda_graph_max_bs=8,
        triton_kernels="off",  # the torch form (fla's kernels: tests/gpu/test_cuda_triton.py)
    )
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, chunk=8, arrival_gap=2) == expected
