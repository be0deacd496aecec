"""The step-composition benchmarks run decode-only, prefill-only and mixed steps on a real ModelRunner, and a
prompt whole and in chunks beside decodes on both attention paths."""

from __future__ import annotations

from batchserve.loadtests.bench_chunked_prefill import measure as measure_chunks
from batchserve.loadtests.bench_step_mix import measure
from batchserve.procs.worker.model_runner import ModelRunner


def test_step_mix_times_every_composition(tiny_model_dir):
    runner = ModelRunner(
        tiny_model_dir("llama"), device="cpu", dtype="float32", kv_capacity_tokens=2048, max_running_requests=4
    )
    times = measure(runner, running=3, prompt_len=10, prefill_len=12, repeats=2)
    assert set(times) == {"decode", "prefill", "mixed"}
    assert all(t > 0 for t in times.values())


def test_chunked_prefill_times_both_paths_and_shapes(tiny_model_dir):
    runner = ModelRunner(
        tiny_model_dir("llama"), device="cpu", dtype="float32", kv_capacity_tokens=4096, max_running_requests=16
    )
    times = measure_chunks(runner, running=3, context=10, prompt_len=30, chunks=[12, 10, 8], repeats=2)
    assert set(times) == {(path, shape) for path in ("c", "sdpa") for shape in ("whole", "chunked")}
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert runner.attention.paged_chunks  # left on the C path
