"""`StepCostModel`: how long a step takes for what it carries, so that a step with prefill in it can be
sized to a time target (`--max-step-ms`) instead of a fixed token budget.

A step's wall time (as the scheduler waits for it: the worker's forward and sampling, and the
sockets) is modelled as

    seconds = w0 + w1 * tokens + w2 * attention_pairs / 1000 + w3 * experts_read

`tokens` drive the linear layers and the LM head; `attention_pairs` (`shared.step_features`) drive
attention; `experts_read` (a mixture-of-experts model's, 0 for a dense one) the expert weights a step
reads, which grow with its tokens until every expert is read: a decode step of one token reads top_k
experts, a step of many all of them, so an MoE step's cost is not linear in its tokens. The weights
come from the worker's startup probe (`WorkerInfo.step_costs`) and are refitted by least squares
from the last measured steps, so the model follows the machine (a shared CPU, graph replay on a GPU).
Sarathi-Serve picks its token budget from profiles for the same reason.

A least-squares fit predicts a step's mean time, and a bound is about the slow steps: each step with
prefill is sized for the target divided by a margin, how much longer than predicted the recent steps
with prefill ran (their 90th percentile). It covers what the three terms miss (a shared CPU's noise,
KV reads from pages scattered over memory, which the startup probe does not see) and follows it.
Once the decodes alone take the target a step is not bounded at all (`prefill_step_s`), so a machine
too slow for the target admits as fast as it can. How the target becomes a step's prompt-token cap
(the prefill share, the demand term) is `procs.scheduler.step_time_cap`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from shared.messages import WorkerInfo
from shared.step_features import attention_pairs, experts_read

if TYPE_CHECKING:
    from procs.scheduler.config import SchedulerConfig

WINDOW = 256  # measured steps the fit remembers
REFIT_EVERY = 16  # steps between refits
# Tokens between the window's smallest and largest step to fit on live steps alone: decode-only steps
# beside steps with even the smallest chunk (32 tokens) reach it.
MIN_LIVE_SPREAD = 16
MARGIN_STEPS = 64  # recent steps with prefill whose actual / predicted times set the margin
MARGIN_QUANTILE = 0.9  # the share of them the margin would have kept within the target
MIN_MARGIN_STEPS = 8  # fewer: no margin yet
MARGIN_RANGE = (0.5, 3.0)  # a margin below 1 lets steps grow when the model overestimates
DRAFT_COST_WEIGHT = 0.1  # the latest step's share of a draft model's moving per-token cost
REPORT_EVERY_S = 60.0  # the refitted model in the log at most this often
log = logging.getLogger("batchserve.scheduler")


class LinearStepCost:
    """The model with fixed weights (w0, w1, w2, w3): what every step-time decision reads. `simulate`
    scripts one; `StepCostModel` fits its weights to measured steps. `margin`: how much longer than
    predicted the slow steps with prefill run (1 here: a scripted cost is exact)."""

    def __init__(self, weights: tuple[float, float, float, float], experts: tuple[int, int] = (0, 0),
                 windows: Sequence[int] = ()) -> None:
        self.weights = weights
        self.experts = experts
        self.windows = tuple(windows)  # each layer's sliding window (`attention_pairs`)
        self.margin = 1.0
        self.draft_token_s = 0.0  # a draft model's seconds to propose one token (`StepCostModel.observe_drafts`)

    def pairs(self, prefix_lens: Sequence[int] | np.ndarray, extend_lens: Sequence[int] | np.ndarray) -> float:
        """The attention pairs of rows feeding `extend_lens` tokens after `prefix_lens`, this model's windows counted."""
        return attention_pairs(prefix_lens, extend_lens, self.windows)

    def predict(self, tokens: float, pairs: float) -> float:
        w0, w1, w2, w3 = self.weights
        return w0 + w1 * tokens + w2 * pairs / 1000 + w3 * experts_read(tokens, *self.experts)

    def prefill_s(self, tokens: float, pairs: float) -> float:
        """What these tokens add to a step, beyond its fixed cost."""
        return self.predict(tokens, pairs) - self.weights[0]

    def prefill_step_s(self, target_s: float, decode_rows: int, decode_pairs: float,
                       min_share: float) -> float | None:
        """How long (as predicted) a step beside these decodes may take: `target_s` less the margin,
        unless that leaves prefill less than `min_share` of the step; then as long as gives prefill that
        share (decodes' time / (1 - min_share)). None: the target is out of reach (the decodes alone take
        it), so the bound protects nothing and the step is not bounded (SCHEDULING.md 6.5)."""
        planned_s = target_s / self.margin
        decode_s = self.predict(decode_rows, decode_pairs)
        if decode_s >= planned_s:
            return None
        return max(planned_s, decode_s / (1 - min_share))

    def min_acceptance(self, decode_rows: int, decode_pairs: float) -> float:
        """Speculative decoding: the share of a draft's tokens that must be accepted for the draft to
        pay, that is to raise the tokens per second of a step of these decodes: what one more token
        costs (w1, and w2 for its attention over an average row's context, and what a draft model
        takes to propose it) over the step's time per row. Small beside one request, near or past 1
        in a batch big enough to be compute-bound."""
        if decode_rows <= 0:
            return 0.0
        step_s = self.predict(decode_rows, decode_pairs)
        added_s = self.predict(decode_rows + 1, decode_pairs * (1 + 1 / decode_rows)) - step_s  # an average row's
        return (added_s + self.draft_token_s) * decode_rows / max(step_s, 1e-9)

    def max_prefill_tokens(self, step_s: float, decode_rows: int, decode_pairs: float, prefix: int,
                           limit: int) -> int:
        """The most prefill tokens (<= limit) a step beside these decodes can carry within a predicted
        `step_s`, for a chunk starting after `prefix` cached tokens; 0 if even none fits."""
        def fits(n: int) -> bool:
            return self.predict(decode_rows + n, decode_pairs + self.pairs([prefix], [n])) <= step_s
        if not fits(1):
            return 0
        low, high = 1, limit  # fits(low); find the largest n that fits (time grows with n)
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        return low


class StepCostModel(LinearStepCost):
    """The weights fitted to the worker's startup probe, then refitted from the steps measured since."""

    def __init__(self, probe: Sequence[tuple[int, float, float]], experts: tuple[int, int] = (0, 0),
                 windows: Sequence[int] = ()) -> None:
        """`probe`: (tokens, attention_pairs, seconds) of steps measured at startup (at least two
        different token counts); `experts`: a mixture of experts' (num_experts, top_k), (0, 0) if dense;
        `windows`: each layer's sliding window (the probe's pairs count them too)."""
        self.experts = experts
        self.windows = tuple(windows)
        self._probe = [(float(t), float(a), float(s)) for t, a, s in probe]
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self._overruns: deque[float] = deque(maxlen=MARGIN_STEPS)  # actual / predicted, steps with prefill
        self._reported_at = time.monotonic()
        weights = self._fit(self._probe)
        if weights is None:
            raise ValueError(f"the step-cost probe cannot be fitted: {probe}")
        super().__init__(weights, experts, windows)

    def observe(self, tokens: int, pairs: float, seconds: float, *, with_prefill: bool = False) -> None:
        """A measured step; `with_prefill`: it carried prompt tokens (a step the target sizes)."""
        if with_prefill:
            self._overruns.append(seconds / max(self.predict(tokens, pairs), 1e-9))
            if len(self._overruns) >= MIN_MARGIN_STEPS:
                quantile = float(np.quantile(self._overruns, MARGIN_QUANTILE))
                self.margin = min(max(quantile, MARGIN_RANGE[0]), MARGIN_RANGE[1])
        self._steps.append((float(tokens), pairs, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            # Live steps alone once they span enough token counts to pin the per-token cost (a probe
            # taken while the machine was busy, say beside other starting servers, would otherwise
            # keep skewing it); before that, the probe fills the gap (steady decode steps alone leave
            # the per-token cost undetermined).
            live = list(self._steps)
            spread = max(t for t, _, _ in live) - min(t for t, _, _ in live)
            fitted = self._fit(live) if spread >= MIN_LIVE_SPREAD else None
            fitted = fitted or self._fit(self._probe + live)
            if fitted is not None:
                self.weights = fitted
            self._report()

    def _report(self) -> None:
        """The model as refitted, in the log at most every `REPORT_EVERY_S` (what a bound plans with)."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_EVERY_S:
            return
        self._reported_at = now
        w0, w1, w2, w3 = self.weights
        log.info("step-cost model", extra={"fields": {
            "ms_per_step": round(w0 * 1000, 2), "ms_per_token": round(w1 * 1000, 4),
            "ms_per_1k_attention_pairs": round(w2 * 1000, 4), "ms_per_expert_read": round(w3 * 1000, 4),
            "margin": round(self.margin, 3)}})

    def observe_drafts(self, seconds: float, draft_tokens: int) -> None:
        """A draft model proposed `draft_tokens` tokens in `seconds` (a moving average per token)."""
        if draft_tokens > 0:
            per_token = seconds / draft_tokens
            self.draft_token_s += DRAFT_COST_WEIGHT * (per_token - self.draft_token_s)

    def _fit(self, rows: Sequence[tuple[float, float, float]]) -> tuple[float, float, float, float] | None:
        """Least squares with non-negative weights (a cost never shrinks as work grows) and a positive
        per-token cost: the best fit over the subsets of {base, attention, experts} kept beside tokens (an
        exact non-negative least squares for these few weights). None when no subset fits."""
        data = np.asarray(rows, dtype=np.float64)
        if data.shape[0] < 2 or np.ptp(data[:, 0]) == 0:
            return None
        experts = [experts_read(t, *self.experts) for t in data[:, 0]]
        columns = np.column_stack([np.ones(data.shape[0]), data[:, 0], data[:, 1] / 1000, experts])
        optional = [0, 2, 3] if self.experts[0] else [0, 2]
        best: tuple[float, np.ndarray] | None = None
        for kept in (sorted([1, *chosen]) for size in range(len(optional), -1, -1)
                     for chosen in itertools.combinations(optional, size)):
            solution, *_ = np.linalg.lstsq(columns[:, kept], data[:, 2], rcond=None)
            if solution.min() < 0 or solution[kept.index(1)] <= 0:
                continue
            weights = np.zeros(4)
            weights[kept] = solution
            residual = float(np.square(columns @ weights - data[:, 2]).sum())
            if best is None or residual < best[0]:
                best = (residual, weights)
        return None if best is None else tuple(float(w) for w in best[1])  # type: ignore[return-value]


def cost_model_for(config: SchedulerConfig, info: WorkerInfo) -> StepCostModel | None:
    """The step-cost model a scheduler sized by the worker's `info` plans with: for the step-time bound,
    or for speculative decoding's break-even share; None when neither needs one (or the worker sent no
    probe of at least two step sizes)."""
    if not (config.max_step_s or config.speculative != "off") or len({t for t, _, _ in info.step_costs}) < 2:
        return None
    return StepCostModel(info.step_costs, (info.moe_experts, info.moe_top_k), info.layer_windows)
