"""`kernels.decode_layers`: every layer of a CPU step (decodes, prefill chunks, both) in one C call must give
exactly the logits of the model's per-op Python loop (the same kernels in the same order), for each architecture
it takes (q/k norms per head and over the projection, clipped q/k/v, mixtures of experts with and without a
shared expert, dense layers between sparse ones), fp32 and int8, over steps whose requests differ in length
and join and leave, and whose prompts are prefilled in chunks beside them."""

from __future__ import annotations

import pytest
import torch

from batchserve.kernels import native
from batchserve.kernels.decode_layers import DecodeLayers
from batchserve.procs.scheduler import Scheduler, SchedulerConfig
from batchserve.procs.worker.lora.step import load_lora_adapter
from batchserve.shared.messages import RequestParams, SamplingParams, StopParams

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the C kernels")

PROMPTS = {"a": [5, 6, 7], "b": list(range(10, 50)), "c": [42], "d": list(range(100, 117))}
LIMITS = {"a": 9, "b": 4, "c": 12, "d": 6}


def run(
    model_dir,
    *,
    fuse: bool,
    quantization: str = "none",
    adapter_folders: tuple = (),
    adapters: dict[str, int] | None = None,
) -> tuple[dict[str, list[int]], list[torch.Tensor], int, int]:
    """`adapter_folders`: PEFT folders loaded as LoRA adapters 1, 2..; `adapters`: each request's (rid -> index).
    Returns the tokens, every step's logits, the fused calls and the steps."""
    from batchserve.procs.worker.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir, device="cpu", max_running_requests=3, kv_capacity_tokens=512, quantization=quantization
    )
    for index, folder in enumerate(adapter_folders, 1):
        load_lora_adapter(runner, index, f"adapter{index}", str(folder), max_rank=16)
    model = runner.model
    assert model.fuse_decode_layers  # every architecture's layers qualify
    model.fuse_decode_layers = fuse
    logits: list[torch.Tensor] = []
    fused_calls = 0
    lm_head, fused_run = model.lm_head_logits, DecodeLayers.run

    def recording_lm_head(hidden: torch.Tensor) -> torch.Tensor:
        out = lm_head(hidden)
        logits.append(out.clone())
        return out

    def counting_run(self, *args, **kwargs):
        nonlocal fused_calls
        fused_calls += 1
        return fused_run(self, *args, **kwargs)

    model.lm_head_logits = recording_lm_head
    sched = Scheduler(
        SchedulerConfig(
            max_running_requests=3,
            prefill_budget=16,
            page_size=runner.page_size,
            kv_capacity_tokens=runner.kv_capacity_tokens,
        ),
        eos_token_ids=(),
    )
    for rid, prompt in PROMPTS.items():  # three at once: "d" joins when the first one leaves
        sched.add_request(
            rid,
            prompt,
            RequestParams(
                sampling=SamplingParams(temperature=0.0),
                stop=StopParams(max_tokens=LIMITS[rid], ignore_eos=True),
                adapter=(adapters or {}).get(rid, 0),
            ),
        )
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    steps = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeLayers, "run", counting_run)
        while sched.has_unfinished():
            steps += 1
            for rid, token in sched.step(runner).new_tokens:
                tokens[rid].append(token)
    return tokens, logits, fused_calls, steps


ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mixtral": {},
    "qwen2_moe": dict(mlp_only_layers=[0]),
    "qwen3_moe": dict(norm_topk_prob=True),
    "olmoe": dict(clip_qkv=2.0),
}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_one_call_per_step_gives_the_python_loops_logits_bit_for_bit(tiny_model_dir, arch, quantization):
    model_dir = tiny_model_dir(arch, **ARCHS[arch])
    loop_tokens, loop_logits, loop_calls, _ = run(model_dir, fuse=False, quantization=quantization)
    fused_tokens, fused_logits, fused_calls, steps = run(model_dir, fuse=True, quantization=quantization)
    assert loop_calls == 0 and fused_calls == steps  # prefill steps and mixed ones too
    assert {rid: len(t) for rid, t in fused_tokens.items()} == LIMITS
    assert fused_tokens == loop_tokens
    assert len(fused_logits) == len(loop_logits)
    for fused, loop in zip(fused_logits, loop_logits):
        assert torch.equal(fused, loop)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_lora_rows_in_the_one_call_give_the_python_loops_logits_bit_for_bit(tiny_model_dir, tmp_path, quantization):
    """Rows of two adapters (all seven projections with rsLoRA; q, v and down) beside base rows: the call adds
    each row's pairs as the layers' Python does (procs/worker/lora/slots.py), so the logits are the same bits."""
    from test_lora_worker import ADAPTERS, make_adapter

    model_dir = tiny_model_dir("llama")
    folders = tuple(
        make_adapter(model_dir, tmp_path / name, seed, **config) for seed, (name, config) in enumerate(ADAPTERS.items())
    )
    lora = dict(adapter_folders=folders, adapters={"a": 1, "b": 0, "c": 2, "d": 1})
    loop_tokens, loop_logits, _, _ = run(model_dir, fuse=False, quantization=quantization, **lora)
    fused_tokens, fused_logits, fused_calls, steps = run(model_dir, fuse=True, quantization=quantization, **lora)
    base_tokens, _, _, _ = run(model_dir, fuse=True, quantization=quantization)
    assert fused_calls == steps and fused_tokens == loop_tokens
    assert fused_tokens["a"] != base_tokens["a"] and fused_tokens["b"] == base_tokens["b"]  # the adapters matter
    assert len(fused_logits) == len(loop_logits)
    for fused, loop in zip(fused_logits, loop_logits):
        assert torch.equal(fused, loop)


def test_mismatched_activations_are_refused(tiny_model_dir):
    from batchserve.procs.worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", max_running_requests=2, kv_capacity_tokens=256)
    layers = runner.model._decode_layers_on(runner.attention)
    hidden, head_dim = runner.config.hidden_size, runner.config.head_dim
    h, cos = torch.zeros(2, hidden), torch.zeros(2, head_dim)
    locs, lens, pages = (
        torch.zeros(2, dtype=torch.int64),
        torch.ones(2, dtype=torch.int64),
        torch.zeros(2, 1, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="residual"):
        layers.run(h, torch.zeros(2, hidden + 1), cos, cos, locs, pages, lens)
    with pytest.raises(ValueError, match="int64"):
        layers.run(h, torch.zeros(2, hidden), cos, cos, locs.int(), pages, lens)
