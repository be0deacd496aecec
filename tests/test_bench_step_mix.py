"""The step-composition benchmark runs decode-only, prefill-only and mixed steps on a real ModelRunner."""

from __future__ import annotations

from loadtests.bench_step_mix import measure
from procs.worker.model_runner import ModelRunner


def test_step_mix_times_every_composition(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", dtype="float32", kv_capacity_tokens=2048,
                         max_running_requests=4)
    times = measure(runner, running=3, prompt_len=10, prefill_len=12, repeats=2)
    assert set(times) == {"decode", "prefill", "mixed"}
    assert all(t > 0 for t in times.values())
