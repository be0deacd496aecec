"""The worker's step pipeline (`procs.worker.step_hooks`): a feature registered as the DESIGN.md map says
("how to add a feature") is called at each of its hooks in the stages' order, on every step, and a
feature that changes nothing changes no output; two features cannot both be the step's verifier or head;
the stages (`ModelRunner.execute`, `Scheduler.launch` and `complete`) name no feature, and the worker's
pipeline core imports no feature package."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from model_batches import generate_greedy
from test_feature_reach import FEATURES, PACKAGES, identifiers

from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.step_hooks import StepHooks
from batchserve.shared.messages import ForwardBatch, StepResult


class CallLog:
    """A no-op feature at every hook that is not exclusive: it records each call and returns what it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, batch: ForwardBatch) -> float:
        self.calls.append(("start", batch.step))
        return 0.0

    def rewrite(self, batch: ForwardBatch) -> ForwardBatch:
        self.calls.append(("rewrite", batch.step))
        return batch

    def before_forward(self, batch: ForwardBatch) -> None:
        self.calls.append(("before_forward", batch.step))

    def after_forward(self, batch: ForwardBatch) -> None:
        self.calls.append(("after_forward", batch.step))

    def annotate(self, result: StepResult) -> None:
        self.calls.append(("annotate", result.step))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _runner(model) -> ModelRunner:
    return ModelRunner(model, device="cpu", page_size=4, kv_capacity_tokens=256, max_running_requests=4, max_context=64)


def test_a_registered_no_op_feature_runs_at_each_hook_in_order_and_changes_nothing(model):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    expected = generate_greedy(_runner(model), prompts, 6, chunk=3, arrival_gap=1)
    runner = _runner(model)
    feature = CallLog()
    runner.hooks.register(feature)
    assert generate_greedy(runner, prompts, 6, chunk=3, arrival_gap=1) == expected
    steps = sorted({step for _, step in feature.calls})
    order = ["start", "rewrite", "before_forward", "after_forward", "annotate"]
    assert len(steps) > 6
    assert feature.calls == [(hook, step) for step in steps for hook in order]


class Head:
    def forward(self, batch: ForwardBatch):
        raise AssertionError("not run")

    def result(self, batch: ForwardBatch, hidden) -> StepResult:
        return StepResult(step=batch.step, next_token_ids=np.zeros(0, dtype=np.int32))


def test_the_step_has_one_head_and_one_verifier():
    hooks = StepHooks()
    hooks.register(Head())
    assert hooks.head is not None and hooks.find(Head) is hooks.head and not hooks.starts
    with pytest.raises(ValueError, match="head"):
        hooks.register(Head())


WORKER = Path(__file__).resolve().parent.parent / "procs" / "worker"


@pytest.mark.parametrize(
    "module, function",
    [("worker/model_runner.py", "execute"), ("scheduler/core.py", "launch"), ("scheduler/core.py", "complete")],
)
def test_the_stages_are_short_and_name_no_feature(module, function):
    tree = ast.parse((WORKER.parent / module).read_text())
    stages = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    assert stages.end_lineno is not None and stages.end_lineno - stages.lineno + 1 <= 40
    names = set(identifiers(stages))
    for feature, (pattern, _) in FEATURES.items():
        assert not [name for name in names if pattern.search(name)], feature


def test_the_worker_core_imports_no_feature_package():
    packages = {p.rstrip("/").replace("/", ".") for own in PACKAGES.values() for p in own}
    for core in ("model_runner.py", "step_hooks.py", "step_sampler.py"):  # (graph_runner.py: LoRA graphs, not yet)
        imported = {
            node.module or ""
            for node in ast.walk(ast.parse((WORKER / core).read_text()))
            if isinstance(node, ast.ImportFrom)
        }
        assert not [m for m in imported if any(m.startswith(f"batchserve.{p}") for p in packages)], core
