"""`StepCostModel`: how long a step takes for what it carries, so that a step with prefill in it can be
sized to a time target (`--max-step-ms`) instead of a fixed token budget.

A step's wall time (as the scheduler waits for it: the worker's forward and sampling, and the
sockets) is modelled from its shape (`shared.step_features.StepShape`) as

    seconds = w_step + w_token * tokens + w_row * rows + w_pairs * attention_pairs / 1000
              + w_expert * experts_read + w_chunked * chunked

`tokens` drive the linear layers; `rows` what each request costs whatever its tokens: its LM head row
and sampling (a prefill chunk of 256 tokens samples once, 256 decode rows 256 times) and a row in every
kernel; `attention_pairs` drive attention (a hybrid model's linear layers count each row's state reads
there); `experts_read` (a mixture-of-experts model's, 0 for a dense one) the expert weights a step
reads, which grow with its tokens until every expert is read: a decode step of one token reads top_k
experts, a step of many all of them, so an MoE step's cost is not linear in its tokens; `chunked` a
hybrid model's linear layers' prefill tokens padded to whole chunks (0 for other models). The weights
come from the worker's startup probe (`WorkerInfo.step_costs`) and are refitted by least squares
from the last measured steps, so the model follows the machine (a shared CPU, graph replay on a GPU).
Sarathi-Serve picks its token budget from profiles for the same reason.

A least-squares fit predicts a step's mean time, and a bound is about the slow steps: each step with
prefill is sized for the target divided by a margin, how much longer than the current fit predicts the
recent steps with prefill ran (their 90th percentile). It covers what the terms miss (a shared CPU's
noise, KV reads from pages scattered over memory, which the startup probe does not see) and follows it.
The margin is taken against the weights in use, not the ones each step was planned with: after a
refit has learnt that a busy start's probe overestimated, a margin of the old overruns would let steps
run up to twice the target (measured: 440 ms steps under `--max-step-ms 250`). A young window refits
often (every few steps), so a probe taken while the server's other processes started is soon replaced.
How the target becomes a step's prompt-token cap (what fits beside the decodes, the floor, no cap
once the decodes alone take the target) is `procs.scheduler.step_time_cap`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from batchserve.shared.process_messages import WorkerInfo
from batchserve.shared.step_features import StepShape, experts_read, step_shape

if TYPE_CHECKING:
    from batchserve.procs.scheduler.config import SchedulerConfig

WINDOW = 256  # measured steps the fit remembers
REFIT_EVERY = 16  # steps between refits (fewer while the window is young: `_refit_due`)
# Tokens between the window's smallest and largest step, and prompt tokens (tokens beyond one a row) between
# the steps with the fewest and the most, to fit on live steps alone: decode-only steps beside steps with even
# the smallest chunk (32 tokens) reach both; decode steps alone cannot tell a token's cost from a row's.
MIN_LIVE_SPREAD = 16
MARGIN_STEPS = 64  # recent steps with prefill whose actual / predicted times set the margin
MARGIN_QUANTILE = 0.9  # the share of them the margin would have kept within the target
MIN_MARGIN_STEPS = 8  # fewer: no margin yet
MARGIN_RANGE = (0.5, 3.0)  # a margin below 1 lets steps grow when the model overestimates
DRAFT_COST_WEIGHT = 0.1  # the latest step's share of a draft model's moving per-token cost
REPORT_EVERY_S = 60.0  # the refitted model in the log at most this often
log = logging.getLogger("batchserve.scheduler")


class CostWeights(msgspec.Struct, frozen=True):
    """Seconds per step, per token, per row, per 1000 attention pairs, per expert read and per chunked token."""

    step: float = 0.0
    token: float = 0.0
    row: float = 0.0
    pairs_1k: float = 0.0
    expert_read: float = 0.0
    chunked: float = 0.0

    def vector(self) -> np.ndarray:
        return np.array(msgspec.structs.astuple(self))

    def log_fields(self) -> dict[str, float]:
        """The weights in milliseconds, as the log shows them."""
        return {
            "ms_per_step": round(self.step * 1000, 2),
            "ms_per_token": round(self.token * 1000, 4),
            "ms_per_row": round(self.row * 1000, 4),
            "ms_per_1k_attention_pairs": round(self.pairs_1k * 1000, 4),
            "ms_per_expert_read": round(self.expert_read * 1000, 4),
            "ms_per_chunked_token": round(self.chunked * 1000, 4),
        }


TOKEN_WEIGHT = CostWeights.__struct_fields__.index("token")  # the one weight every fit keeps, and keeps > 0
ROW_WEIGHT = CostWeights.__struct_fields__.index("row")


def features(shape: StepShape, experts: tuple[int, int]) -> np.ndarray:
    """The shape's terms in `CostWeights`' order."""
    return np.array(
        [1.0, shape.tokens, shape.rows, shape.pairs / 1000, experts_read(shape.tokens, *experts), shape.chunked]
    )


class LinearStepCost:
    """The model with fixed weights: what every step-time decision reads. `simulate` scripts one;
    `StepCostModel` fits its weights to measured steps. `margin`: how much longer than predicted the slow
    steps with prefill run (1 here: a scripted cost is exact)."""

    def __init__(self, weights: CostWeights, experts: tuple[int, int] = (0, 0), windows: Sequence[int] = ()) -> None:
        self.weights = weights
        self.experts = experts
        self.windows = tuple(windows)  # each layer's cost window (`shared.step_features.layer_cost_windows`)
        self.margin = 1.0
        self.draft_token_s = 0.0  # a draft model's seconds to propose one token (`StepCostModel.observe_drafts`)

    def shape(self, prefix_lens: Sequence[int] | np.ndarray, extend_lens: Sequence[int] | np.ndarray) -> StepShape:
        """The shape of rows feeding `extend_lens` tokens after `prefix_lens`, this model's windows counted."""
        return step_shape(prefix_lens, extend_lens, self.windows)

    def predict(self, shape: StepShape) -> float:
        return float(self.weights.vector() @ features(shape, self.experts))

    def min_acceptance(self, decodes: StepShape) -> float:
        """Speculative decoding: the share of a draft's tokens that must be accepted for the draft to
        pay, that is to raise the tokens per second of a step of these decodes: what one more token
        costs (its linear layers, and its attention over an average row's context, and what a draft
        model takes to propose it; no row: it widens one) over the step's time per row. Small beside
        one request, near or past 1 in a batch big enough to be compute-bound."""
        if decodes.rows <= 0:
            return 0.0
        step_s = self.predict(decodes)
        wider = StepShape(decodes.tokens + 1, decodes.rows, decodes.pairs * (1 + 1 / decodes.rows), decodes.chunked)
        added_s = self.predict(wider) - step_s  # an average row's
        return (added_s + self.draft_token_s) * decodes.rows / max(step_s, 1e-9)

    def max_prefill_tokens(self, step_s: float, decodes: StepShape, prefix: int, limit: int) -> int:
        """The most prefill tokens (<= limit) a step beside these decodes can carry within a predicted
        `step_s`, for a chunk starting after `prefix` cached tokens; 0 if even none fits."""

        def fits(n: int) -> bool:
            return self.predict(decodes + self.shape([prefix], [n])) <= step_s

        if not fits(1):
            return 0
        # find the largest n that fits: time grows with n (in steps of a chunk where chunks are padded)
        low, high = 1, limit
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        return low


class StepCostModel(LinearStepCost):
    """The weights fitted to the worker's startup probe, then refitted from the steps measured since."""

    def __init__(
        self, probe: Sequence[tuple[StepShape, float]], experts: tuple[int, int] = (0, 0), windows: Sequence[int] = ()
    ) -> None:
        """`probe`: (shape, seconds) of steps measured at startup (at least two different token counts);
        `experts`: a mixture of experts' (num_experts, top_k), (0, 0) if dense; `windows`: each layer's
        cost window (the probe's shapes count them too)."""
        self.experts = experts
        self.windows = tuple(windows)
        self._steps: deque[np.ndarray] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self._with_prefill: deque[np.ndarray] = deque(maxlen=MARGIN_STEPS)  # recent steps with prefill, measured
        self._reported_at = time.monotonic()
        # each measured step as its terms (`features`) and then its seconds: what a fit reads
        self._probe = np.array([self._measured(shape, s) for shape, s in probe]).reshape(len(probe), -1)
        weights = self._fit(self._probe)
        if weights is None:
            raise ValueError(f"the step-cost probe cannot be fitted: {probe}")
        super().__init__(weights, experts, windows)

    def observe(self, shape: StepShape, seconds: float, *, with_prefill: bool = False) -> None:
        """A measured step; `with_prefill`: it carried prompt tokens (a step the target sizes)."""
        measured = self._measured(shape, seconds)
        self._steps.append(measured)
        if with_prefill:
            self._with_prefill.append(measured)
        self._since_fit += 1
        refit = self._refit_due()
        if refit:
            self._since_fit = 0
            # Live steps alone once they span enough tokens and prompt tokens to pin a token's cost and a
            # row's (a probe taken while the machine was busy, say beside other starting servers, would
            # otherwise keep skewing them); before that, the probe fills the gap (steady decode steps alone
            # leave the per-token cost undetermined).
            live = np.stack(self._steps)
            fitted = self._fit(live) if self._determines_weights(live) else None
            fitted = fitted or self._fit(np.vstack([self._probe, live]))
            if fitted is not None:
                self.weights = fitted
            self._report()
        if refit or with_prefill:
            self._update_margin()

    def _refit_due(self) -> bool:
        """Every `REFIT_EVERY` steps, sooner while the window is young (after steps 1, 2, 3, 5, 7, 10, 14,
        19, ...), so the first live steps replace a probe that the server's own starting processes slowed."""
        return self._since_fit >= min(REFIT_EVERY, 1 + len(self._steps) // 4)

    def _update_margin(self) -> None:
        """The 90th percentile of actual / predicted over the recent steps with prefill, predicted by the
        weights in use."""
        if len(self._with_prefill) < MIN_MARGIN_STEPS:
            return
        steps = np.stack(self._with_prefill)
        ratios = steps[:, -1] / np.maximum(steps[:, :-1] @ self.weights.vector(), 1e-9)
        self.margin = min(max(float(np.quantile(ratios, MARGIN_QUANTILE)), MARGIN_RANGE[0]), MARGIN_RANGE[1])

    def _measured(self, shape: StepShape, seconds: float) -> np.ndarray:
        return np.append(features(shape, self.experts), seconds)

    @staticmethod
    def _determines_weights(steps: np.ndarray) -> bool:
        """Whether measured steps (`_measured`) can be fitted alone: they spread enough in tokens, and in
        tokens beyond a row's one, and no term of theirs is a mix of the others."""
        tokens = steps[:, TOKEN_WEIGHT]
        if min(np.ptp(tokens), np.ptp(tokens - steps[:, ROW_WEIGHT])) < MIN_LIVE_SPREAD:
            return False
        columns = steps[:, :-1]
        columns = columns[:, columns.any(axis=0)] / np.abs(columns).max(axis=0)[columns.any(axis=0)]
        # twice as many steps as terms: a young window's few steps would otherwise be fitted exactly, noise and all
        return (
            steps.shape[0] >= 2 * columns.shape[1] and int(np.linalg.matrix_rank(columns, tol=1e-6)) == columns.shape[1]
        )

    def _report(self) -> None:
        """The model as refitted, in the log at most every `REPORT_EVERY_S` (what a bound plans with)."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_EVERY_S:
            return
        self._reported_at = now
        log.info("step-cost model", extra={"fields": {**self.weights.log_fields(), "margin": round(self.margin, 3)}})

    def observe_drafts(self, seconds: float, draft_tokens: int) -> None:
        """A draft model proposed `draft_tokens` tokens in `seconds` (a moving average per token)."""
        if draft_tokens > 0:
            per_token = seconds / draft_tokens
            self.draft_token_s += DRAFT_COST_WEIGHT * (per_token - self.draft_token_s)

    @staticmethod
    def _fit(steps: np.ndarray) -> CostWeights | None:
        """Least squares with non-negative weights (a cost never shrinks as work grows) and a positive
        per-token cost: the best fit over the subsets of the other terms kept beside tokens (an exact
        non-negative least squares for these few weights; a term that is 0 in every step is left out).
        None when no subset fits. `steps`: measured steps (`_measured`)."""
        if steps.shape[0] < 2 or np.ptp(steps[:, TOKEN_WEIGHT]) == 0:
            return None
        columns, seconds = steps[:, :-1], steps[:, -1]
        optional = [i for i in range(columns.shape[1]) if i != TOKEN_WEIGHT and columns[:, i].any()]
        best: tuple[float, np.ndarray] | None = None
        for kept in (
            sorted([TOKEN_WEIGHT, *chosen])
            for size in range(len(optional), -1, -1)
            for chosen in itertools.combinations(optional, size)
        ):
            solution, *_ = np.linalg.lstsq(columns[:, kept], seconds, rcond=None)
            if solution.min() < 0 or solution[kept.index(TOKEN_WEIGHT)] <= 0:
                continue
            weights = np.zeros(columns.shape[1])
            weights[kept] = solution
            residual = float(np.square(columns @ weights - seconds).sum())
            if best is None or residual < best[0]:
                best = (residual, weights)
        return None if best is None else CostWeights(*(float(w) for w in best[1]))


def cost_model_for(config: SchedulerConfig, info: WorkerInfo) -> StepCostModel | None:
    """The step-cost model a scheduler sized by the worker's `info` plans with: for the step-time bound,
    or for speculative decoding's break-even share; None when neither needs one (or the worker sent no
    probe of at least two step sizes)."""
    if not (config.max_step_s or config.speculative != "off") or len({s.tokens for s, _ in info.step_costs}) < 2:
        return None
    return StepCostModel(info.step_costs, (info.moe_experts, info.moe_top_k), info.layer_windows)
