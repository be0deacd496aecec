"""The step-time bound's planning (SCHEDULING.md 6.5): how many prompt tokens the next step may carry so
that it takes about `target_s` beside its decodes.

Sarathi-Serve's rule with a time target in place of a token budget: a step's prefill is what fits
beside its decodes within the target (as the step-cost model predicts it, the target divided by the
model's margin). While requests wait, every step carries at least a floor, `floor_share` of what a step
of the target could prefill with no decodes (never below `MIN_PREFILL_TOKENS`): admission never stops,
and a step runs past the target by at most that much. Overload then shows as the waiting queue's time
(TTFT), not as longer steps for every stream.

A step with nothing decoding is not bounded: the bound protects decoding streams' gaps, and there are none
(a lone prompt in chunks of the floor took 1.8x its unbounded time to its first token on a 1B model).

When the decodes alone take the target (a slow or shared machine, or a running set admitted before it
slowed), the target is out of reach and throughput wins: the step is not bounded (it plans with the
whole budget, as `--max-step-ms -1` does). Measured beside a CPU hog (SCHEDULING.md 6.5): stretching
such a step in proportion finished 0.82x the unbounded scheduler's requests, a prefill share of half
the step 0.5x. The scheduler says so once in its log and counts those steps.

`StepTimeCap` reads a step-cost model (`procs.scheduler.step_cost`: the server's fitted one, or
`simulate`'s scripted `LinearStepCost`), so that the same rule runs in the server and in exact traces.
"""

from __future__ import annotations

import logging
from typing import Protocol

from batchserve.procs.scheduler.step_cost import LinearStepCost
from batchserve.shared.step_features import StepShape

log = logging.getLogger("batchserve.scheduler")

MIN_PREFILL_TOKENS = 32  # the floor's own floor, however slow the machine or small the share


class StepLoad(Protocol):
    """What the cap reads of the scheduler's state (`StepPlanner` is one)."""

    def decode_load(self) -> StepShape: ...
    def has_prefill_work(self) -> bool: ...
    def prefill_prefix(self) -> int: ...


class StepTimeCap:
    """SCHEDULING.md 6.5: the prompt tokens a step may carry within `target_s` beside its decodes, never
    below the floor; None (the budget alone) when nothing decodes or the decodes alone take the target."""

    def __init__(self, cost: LinearStepCost, target_s: float, floor_share: float, budget: int) -> None:
        self.cost = cost
        self.target_s = target_s
        self.floor_share = floor_share
        self.budget = budget
        self.steps_out_of_reach = 0  # steps with prefill work whose decodes alone were predicted over the target
        self._said_out_of_reach = False
        self._floor: tuple[tuple[float, object], int] | None = None  # (planned_s, weights) -> floor, the last one

    def prompt_tokens(self, load: StepLoad) -> int | None:
        cost = self.cost
        decodes = load.decode_load()
        if not decodes.rows:  # nothing decodes: no stream's gaps to bound, the budget alone (SCHEDULING.md 6.5)
            return None
        planned_s = self.target_s / cost.margin
        decode_s = cost.predict(decodes)
        if decode_s < planned_s:
            fits = cost.max_prefill_tokens(planned_s, decodes, load.prefill_prefix(), self.budget)
            return max(fits, self.floor_tokens(planned_s))
        if load.has_prefill_work():
            self._out_of_reach(decode_s)
        return None

    def floor_tokens(self, planned_s: float) -> int:
        """`floor_share` of the prompt tokens a step of `planned_s` could prefill with no decodes, at least
        `MIN_PREFILL_TOKENS` (and at most the budget). Kept until the margin or the weights change: it is
        asked every step, and its search cost as much as the step's own (0.1 ms)."""
        key = (planned_s, self.cost.weights)
        if self._floor is None or self._floor[0] != key:
            alone = self.cost.max_prefill_tokens(planned_s, StepShape(), 0, self.budget)
            self._floor = key, min(self.budget, max(MIN_PREFILL_TOKENS, int(self.floor_share * alone)))
        return self._floor[1]

    def _out_of_reach(self, decode_s: float) -> None:
        self.steps_out_of_reach += 1
        if not self._said_out_of_reach:
            self._said_out_of_reach = True
            log.warning(
                "the step-time target is out of reach: the decodes alone take longer, so steps are not "
                "bounded while they do",
                extra={
                    "fields": {"max_step_ms": round(self.target_s * 1000, 1), "decode_ms": round(decode_s * 1000, 1)}
                },
            )
