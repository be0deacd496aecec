"""Gated DeltaNet on flash-linear-attention's Triton kernels (`kernels.triton.gated_delta`, issue 69) on CPU
tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; tests/triton_interpreter.py
patches what fla needs there): the chunked form over two packed sequences (one crossing a 64-token chunk,
grouped value heads, nonzero states) and then a decode step from the states it left, both within 1e-5 of
`kernels.gated_delta`'s torch; and a tiny Qwen3.5 served through the CUDA path's code (`triton_kernels="on"`)
greedy token-identical to transformers, prompts packed into one call and prefill beside decodes; the launch
count shows the kernels ran (a silent fallback to torch fails)."""

from __future__ import annotations

import pytest
import torch
import triton_interpreter
from model_batches import generate_greedy
from model_references import small_runner
from test_model_equivalence import transformers_greedy

pytest.importorskip("triton")
pytest.importorskip("fla")
triton_interpreter.install()
# numpy evaluates fla's exp2 over whole blocks, the masked-out pairs (later minus earlier log decays) included,
# which overflow before tl.where drops them, as on a GPU
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")

from batchserve.kernels import triton as triton_kernels  # noqa: E402
from batchserve.kernels.gated_delta import chunk_gated_delta_rule, gated_delta_step  # noqa: E402
from batchserve.kernels.triton.gated_delta import chunk_rule, recurrent_step  # noqa: E402

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 8  # two value heads per key head
LENGTHS = (70, 5)  # the first crosses a 64-token chunk


def _inputs(rows: int, generator: torch.Generator):
    """q, k, v as the layer has them (views of one convolution output), g (log decay) and beta."""
    key, value = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
    mixed = torch.randn(rows, 2 * key + value, generator=generator)
    q, k, v = mixed.split([key, key, value], dim=1)
    g = -0.3 * torch.rand(rows, VALUE_HEADS, generator=generator)
    beta = torch.rand(rows, VALUE_HEADS, generator=generator)
    return (
        q.view(rows, KEY_HEADS, KEY_DIM),
        k.view(rows, KEY_HEADS, KEY_DIM),
        v.view(rows, VALUE_HEADS, VALUE_DIM),
        g,
        beta,
    )


def test_chunked_then_recurrent_equal_torch():
    generator = torch.Generator().manual_seed(7)
    q, k, v, g, beta = _inputs(sum(LENGTHS), generator)
    states = 0.3 * torch.randn(len(LENGTHS), VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=generator)
    bounds = torch.tensor([0, LENGTHS[0], sum(LENGTHS)])
    out, final = chunk_rule(q, k, v, g, beta, states.clone(), bounds, bounds)
    assert out.shape == v.shape and final.shape == states.shape and final.dtype == torch.float32
    for i, (start, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        span = slice(start, end)
        want, want_state = chunk_gated_delta_rule(q[span], k[span], v[span], g[span], beta[span], states[i])
        assert (out[span] - want).abs().max() < 1e-5 and (final[i] - want_state).abs().max() < 1e-5

    step = _inputs(len(LENGTHS), generator)  # one token of each, after the states the chunks left
    out, after = recurrent_step(*step, final.clone())
    want, want_state = gated_delta_step(*step, final)
    assert (out - want).abs().max() < 1e-5 and (after - want_state).abs().max() < 1e-5


NEW_TOKENS = 4
SCHEDULES = {
    "packed": (dict(), False),  # both prompts in one step: two sequences in one chunked call
    # chunks of 32: the first prompt's last chunk packed beside the second's, the third's prefill beside the
    # others' decodes; decode batches padded as CUDA graphs run them (padded rows: the dummy slot)
    "beside_decodes": (dict(chunk=32, arrival_gap=2), True),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (70, 9, 13)]


# Two Gated DeltaNet layers (each reads its own states), then full attention; 2 key heads serving 4 value heads:
# half the hybrid tests' heads and layers, as each kernel program costs the interpreter a fraction of a second
TINY = dict(
    arch="qwen3_5",
    num_hidden_layers=3,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


@pytest.fixture(scope="module")
def qwen3_5(tiny_model_dir):
    model_dir = tiny_model_dir(**TINY)
    return model_dir, transformers_greedy(model_dir, _prompts(), NEW_TOKENS)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tiny_qwen3_5_through_the_triton_kernels_equals_transformers(qwen3_5, triton_on, schedule):
    model_dir, expected = qwen3_5
    batching, pad_decode = SCHEDULES[schedule]
    runner = small_runner(model_dir, triton_kernels="on", pad_decode=pad_decode)
    assert triton_kernels.enabled()
    before = triton_kernels.LAUNCHES["gated_delta"]
    assert generate_greedy(runner, _prompts(), NEW_TOKENS, **batching) == expected
    assert triton_kernels.LAUNCHES["gated_delta"] > before  # the kernels ran: no silent fallback to torch
