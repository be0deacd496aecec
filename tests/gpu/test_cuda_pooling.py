"""CUDA only (skipped elsewhere): the pooling runner's encoder path on the GPU (issue 48), on a tiny random
BERT of head_dim 64 (flashinfer's sizes): its bidirectional attention (`causal` off) through the torch
backend in fp32 equal to transformers' `BertModel` within 1e-4, and through flashinfer's prefill wrapper
(planned with causal=False) in bfloat16 close to the torch backend's on the same GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pooling_models import build_encoder, write_st_files

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig
from batchserve.shared.pooling import finish_vector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = dict(hidden_size=128, num_attention_heads=2, intermediate_size=256)
TEXTS = [" ".join(f"w{5 + (7 * i + j) % 300}" for j in range(n)) for i, n in enumerate((5, 40, 17, 1, 60))]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return write_st_files(build_encoder(tmp_path_factory.mktemp("bert") / "model", **SHAPE), "mean", normalize=False)


def vectors(model_dir, dtype: str, backend: str) -> np.ndarray:
    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            device="cuda",
            dtype=dtype,
            attention_backend=backend,
            page_size=16,
            kv_capacity_tokens=2048,
            max_running_requests=8,
        )
    )
    done = engine.generate([request(f"r{i}", prompt=t, pooling={}) for i, t in enumerate(TEXTS)])
    return np.stack([finish_vector(c.pooled, None, False) for c in done])


def test_fp32_vectors_equal_transformers(encoder):
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(encoder), AutoModel.from_pretrained(encoder).eval()
    with torch.no_grad():
        reference = np.stack(
            [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0].mean(0).numpy() for t in TEXTS]
        )
    np.testing.assert_allclose(vectors(encoder, "float32", "torch"), reference, atol=1e-4)


def test_flashinfer_bidirectional_prefill_matches_the_torch_backend(encoder):
    pytest.importorskip("flashinfer")
    got, reference = vectors(encoder, "bfloat16", "flashinfer"), vectors(encoder, "bfloat16", "torch")
    np.testing.assert_allclose(got, reference, atol=0.05, rtol=0.05)
