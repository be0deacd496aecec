"""The scheduler's step as stages, and the hooks a feature plugs in at (`Scheduler.launch` / `complete`):

    launch:   open the step -> before plan -> plan the step (fit its pages) -> pack the batch
    complete: record the tokens -> on tokens -> finish the requests that ended -> after complete

- **before plan** (`BeforePlan`): what must happen before the policy plans: preemption for the waiting
  queue's head (the priority policy), a recompute at a rope's switch, pages behind a sliding window given
  back, drafts proposed for the decode rows. `drain` completes the steps in flight where a hook needs every
  token known (None: the caller cannot drain).
- **on tokens** (`OnTokens`): what came back with a step's kept tokens, before the requests that ended
  are finished (the pooling runner's vectors).
- **after complete** (`AfterComplete`): what the step's result asks after its tokens (requests whose
  grammar failed end with an error; pages behind a window once nothing is in flight).

Each hook is a Protocol over a callable; the features are registered once, as the scheduler is built,
from its configuration (`procs.scheduler.features`), in the order they run. One that is off is not
registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from batchserve.procs.scheduler.step_output import KeptTokens, LaunchedStep, StepOutput
from batchserve.shared.messages import StepResult

Drain = Callable[[], None] | None


class BeforePlan(Protocol):
    def __call__(self, out: StepOutput, drain: Drain, /) -> None: ...


class OnTokens(Protocol):
    def __call__(self, launched: LaunchedStep, result: StepResult, kept: KeptTokens, /) -> None: ...


class AfterComplete(Protocol):
    def __call__(self, out: StepOutput, result: StepResult, /) -> None: ...


@dataclass
class SchedulerHooks:
    before_plan: list[BeforePlan] = field(default_factory=list)
    on_tokens: list[OnTokens] = field(default_factory=list)
    after_complete: list[AfterComplete] = field(default_factory=list)

    def run_before_plan(self, out: StepOutput, drain: Drain) -> None:
        for hook in self.before_plan:
            hook(out, drain)

    def run_on_tokens(self, launched: LaunchedStep, result: StepResult, kept: KeptTokens) -> None:
        for hook in self.on_tokens:
            hook(launched, result, kept)

    def run_after_complete(self, out: StepOutput, result: StepResult) -> None:
        for hook in self.after_complete:
            hook(out, result)
