"""The step-time bound's planning (SCHEDULING.md 6.5): how many prompt tokens the next step may carry
so that it takes about `max_step_s`, given its decodes, the requests waiting, and the prompts arriving.

`StepTimeCap` reads a step-cost model (`procs.scheduler.step_cost`: the server's fitted one, or
`simulate`'s scripted `LinearStepCost`) and a clock (the server's monotonic one, or `simulate`'s
sum of its scripted step times), so that the same rules run in the server and in exact traces.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from procs.scheduler.step_cost import LinearStepCost
from shared.step_features import StepShape, step_shape

log = logging.getLogger("batchserve.scheduler")

# A step sized to the time bound still prefills this much, however long its decodes alone take, so
# that waiting requests always progress.
MIN_PREFILL_TOKENS = 32
MAX_PREFILL_SHARE = 0.9  # a share of 1 would let a step grow without end
DEMAND_WINDOW_S = 10.0  # arrivals whose prompts make up the prefill demand
DEMAND_HEADROOM = 1.5  # prefill's share of a step covers the demand this many times over


def prefill_share(min_share: float, prefilling: int, decoding: int, most: float, demand: float = 0.0) -> float:
    """The least share of a step's time that prefill gets: each request in the server an equal share
    (the decoding ones' is their row), so the requests that wait for or are in prefill get theirs
    together; at least `demand` (`PrefillDemand.share`: what keeps up with the prompts arriving);
    never below `min_share`, nor above `most` (a share of 1 would let a step grow without end)."""
    share = prefilling / (prefilling + decoding) if prefilling else 0.0
    return min(max(min_share, share, demand), most)


class PrefillDemand:
    """The prompts that arrived in the last `DEMAND_WINDOW_S` seconds, as the share of the machine's
    time their prefill takes (what the prefix cache already holds of them aside). A bound that gives
    prefill less than that share of every step admits slower than requests arrive: the waiting queue
    grows until fewer requests decode (so each step's decodes shrink and prefill's share grows), at a
    cost in throughput and time to first token."""

    def __init__(self, window_s: float = DEMAND_WINDOW_S, layer_windows: Sequence[int] = ()) -> None:
        self.window_s = window_s
        self.layer_windows = tuple(layer_windows)  # each layer's sliding window (`attention_pairs`)
        self._arrivals: deque[tuple[float, StepShape]] = deque()  # (time, the prompt's rows to compute)
        self._sum = StepShape()  # the window's

    def arrived(self, prompt_tokens: int, cached_tokens: int, now: float) -> None:
        """A prompt of `prompt_tokens`, the first `cached_tokens` of which the prefix cache holds."""
        shape = step_shape([cached_tokens], [prompt_tokens - cached_tokens], self.layer_windows)
        self._arrivals.append((now, shape))
        self._sum += shape
        self._forget(now)

    def share(self, cost: LinearStepCost, now: float) -> float:
        """`DEMAND_HEADROOM` times the seconds of prefill that the window's prompts need (as `cost`
        predicts them, beyond a step's fixed cost) per second of the window."""
        self._forget(now)
        if not self._arrivals:
            return 0.0
        return DEMAND_HEADROOM * cost.prefill_s(self._sum) / self.window_s

    def _forget(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            _, shape = self._arrivals.popleft()
            self._sum = self._sum + StepShape(-shape.tokens, -shape.rows, -shape.pairs, -shape.chunked)


class StepLoad(Protocol):
    """What the cap reads of the scheduler's state (`StepPlanner` is one)."""

    @property
    def num_prefilling(self) -> int: ...
    @property
    def num_decoding(self) -> int: ...
    def decode_load(self) -> StepShape: ...
    def has_prefill_work(self) -> bool: ...
    def prefill_prefix(self) -> int: ...


class StepTimeCap:
    """SCHEDULING.md 6.5: the prompt tokens a step may carry within `target_s` beside its decodes, never
    below `MIN_PREFILL_TOKENS` nor below what gives prefill its share of the step; None when the
    decodes alone take the target (out of reach: the step is not bounded)."""

    def __init__(self, cost: LinearStepCost, target_s: float, min_share: float, budget: int,
                 clock: Callable[[], float]) -> None:
        self.cost = cost
        self.target_s = target_s
        self.min_share = min_share
        self.budget = budget
        self.clock = clock
        self.demand = PrefillDemand(layer_windows=cost.windows)  # the prompts arriving, which the prefill share keeps up with
        self.steps_out_of_reach = 0  # steps with prefill work whose decodes alone were predicted over the target
        self._said_out_of_reach = False

    def arrived(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.demand.arrived(prompt_tokens, cached_tokens, self.clock())

    def prompt_tokens(self, load: StepLoad) -> int | None:
        cost = self.cost
        decodes = load.decode_load()
        share = prefill_share(self.min_share, load.num_prefilling, load.num_decoding, MAX_PREFILL_SHARE,
                              self.demand.share(cost, self.clock()))
        step_s = cost.prefill_step_s(self.target_s, decodes, share)
        if step_s is None:  # out of reach: run as the unbounded scheduler does
            if load.has_prefill_work():
                self._out_of_reach(decodes)
            return None
        fits = cost.max_prefill_tokens(step_s, decodes, load.prefill_prefix(), self.budget)
        return max(fits, MIN_PREFILL_TOKENS)

    def _out_of_reach(self, decodes: StepShape) -> None:
        self.steps_out_of_reach += 1
        if not self._said_out_of_reach:
            self._said_out_of_reach = True
            log.warning("the step-time target is out of reach: the decodes alone take longer, so steps are not "
                        "bounded while they do", extra={"fields": {
                            "max_step_ms": round(self.target_s * 1000, 1),
                            "decode_ms": round(self.cost.predict(decodes) * 1000, 1),
                            "decode_rows": int(decodes.rows)}})
