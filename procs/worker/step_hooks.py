"""The worker's step pipeline and the hooks a feature plugs into it (`ModelRunner.execute`):

    fill future tokens -> start -> rewrite -> [before forward -> forward -> after forward] -> result -> sample

- **start** (every rank): the step's per-step updates and its new slots (`StartsStep.start`; returns the
  seconds of set-up work it did, e.g. loading an adapter, reported as `StepResult.setup_s`).
- **rewrite** (the sampling rank): the batch as the model runs it (`RewritesBatch.rewrite`: a draft model
  fills its proposal placeholders).
- **before / after forward** (every rank, around the model): per-step inputs the model reads and state it
  leaves (`WrapsForward`: the rows of each adapter, recurrent states restored and kept).
- **result** (the sampling rank): fields of the step's result (`AnnotatesResult.annotate`).
- **sample**: the step's logits into tokens (`StepSampler`); where rows carried proposals, the feature that
  proposed them is told what verification accepted (`VerifiesRows`). A feature whose step ends in something
  other than tokens replaces forward and sample (`StepHead`: the pooling runner's vectors).

Each hook is a Protocol; a feature is an object implementing some of them, registered once at start
(`procs.worker.features`). A feature that is off is not registered, so its hooks cost nothing. The order of
registration is the order of calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from batchserve.shared.messages import ForwardBatch, StepResult

T = TypeVar("T")


@runtime_checkable
class StartsStep(Protocol):
    def start(self, batch: ForwardBatch) -> float: ...


@runtime_checkable
class RewritesBatch(Protocol):
    def rewrite(self, batch: ForwardBatch) -> ForwardBatch: ...


@runtime_checkable
class WrapsForward(Protocol):
    def before_forward(self, batch: ForwardBatch) -> None: ...

    def after_forward(self, batch: ForwardBatch) -> None: ...


@runtime_checkable
class AnnotatesResult(Protocol):
    def annotate(self, result: StepResult) -> None: ...


class RowDistributions(Protocol):
    """The distributions proposed tokens were drawn from: `positions` index the step's sampled positions
    with a drawn proposal after them; `probs[i]` is that proposal's distribution (rejection sampling)."""

    @property
    def positions(self) -> np.ndarray: ...

    @property
    def probs(self) -> torch.Tensor: ...


@runtime_checkable
class VerifiesRows(Protocol):
    @property
    def distributions(self) -> RowDistributions | None: ...

    def verified(self, batch: ForwardBatch, accepted: np.ndarray) -> None: ...


@runtime_checkable
class StepHead(Protocol):
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def result(self, batch: ForwardBatch, hidden: torch.Tensor) -> StepResult: ...


@dataclass
class StepHooks:
    """The registered features, sorted by the hooks they implement."""

    starts: list[StartsStep] = field(default_factory=list)
    rewrites: list[RewritesBatch] = field(default_factory=list)
    wraps: list[WrapsForward] = field(default_factory=list)
    annotates: list[AnnotatesResult] = field(default_factory=list)
    verifier: VerifiesRows | None = None
    head: StepHead | None = None
    features: list[object] = field(default_factory=list)

    def register(self, feature: object) -> None:
        """Add `feature` at every hook it implements (at most one verifier and one head)."""
        if isinstance(feature, StartsStep):
            self.starts.append(feature)
        if isinstance(feature, RewritesBatch):
            self.rewrites.append(feature)
        if isinstance(feature, WrapsForward):
            self.wraps.append(feature)
        if isinstance(feature, AnnotatesResult):
            self.annotates.append(feature)
        for hook, kind in (("verifier", VerifiesRows), ("head", StepHead)):
            if isinstance(feature, kind):
                if getattr(self, hook) is not None:
                    raise ValueError(f"two features want to be the step's {hook}")
                setattr(self, hook, feature)
        self.features.append(feature)

    def find(self, kind: type[T]) -> T | None:
        """The registered feature of class `kind` (None: not registered)."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    def start(self, batch: ForwardBatch) -> float:
        return sum(hook.start(batch) for hook in self.starts)

    def rewrite(self, batch: ForwardBatch) -> ForwardBatch:
        for hook in self.rewrites:
            batch = hook.rewrite(batch)
        return batch

    def before_forward(self, batch: ForwardBatch) -> None:
        for hook in self.wraps:
            hook.before_forward(batch)

    def after_forward(self, batch: ForwardBatch) -> None:
        for hook in self.wraps:
            hook.after_forward(batch)

    def annotate(self, result: StepResult) -> None:
        for hook in self.annotates:
            hook.annotate(result)
