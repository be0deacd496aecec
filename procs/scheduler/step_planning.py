"""Step planning: what the next step runs, before anything is allocated or launched.

`StepPlanner` gives drafts to the decode rows that may have one (speculative decoding), sizes the
step's prompt tokens to the step-time target (`StepTimeCap`, SCHEDULING.md 6.5), has the policy
choose the batch (`managers.POLICY_PLANNERS`, step 3), and finds the requests step 3b must preempt
for the batch's pages. The scheduler core applies what it plans (preemptions, allocation, launch).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from batchserve.procs.scheduler.batch import StepPlan
from batchserve.procs.scheduler.config import SchedulerConfig
from batchserve.procs.scheduler.kv_manager import KVManager
from batchserve.procs.scheduler.managers import POLICY_PLANNERS, DecodeManager, PrefillManager
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.procs.scheduler.speculation.draft_placeholders import DraftPlaceholders
from batchserve.procs.scheduler.speculation.ngram import NgramProposer
from batchserve.procs.scheduler.step_cost import LinearStepCost
from batchserve.procs.scheduler.step_time_cap import StepTimeCap
from batchserve.shared.step_features import StepShape, step_shape


class Proposer(Protocol):
    """Proposes drafts: at most `limit` tokens to follow request `rid`'s `history` (its prompt and output
    so far); none is a fine answer. `NgramProposer`, `DraftPlaceholders`, or `simulate`'s scripted one."""

    def propose(self, history: np.ndarray, limit: int, rid: str) -> np.ndarray: ...


def default_proposer(config: SchedulerConfig) -> Proposer | None:
    """Prompt lookup when `config.speculative` is "ngram", the worker's draft model's placeholders when
    "draft", else none."""
    if config.speculative == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    if config.speculative == "draft":
        return DraftPlaceholders(config.num_speculative_tokens)
    return None


class PlannedStep:
    """A plan and what its pages need: each item's slot, the KV positions it adds, the pages it grows by,
    and the slots step 3b must preempt for them (empty: it fits)."""

    __slots__ = ("plan", "slots", "tokens", "growth", "victims")

    def __init__(self, plan: StepPlan, kv: KVManager, by_priority: bool) -> None:
        self.plan = plan
        self.slots, self.tokens = plan.slots_and_tokens()
        self.growth = kv.growth(self.slots, self.tokens)
        self.victims = kv.preemption_victims(self.slots, self.growth, by_priority)


class StepPlanner:
    def __init__(
        self,
        config: SchedulerConfig,
        table: RequestTable,
        kv: KVManager,
        prefill: PrefillManager,
        decode: DecodeManager,
        proposer: Proposer | None,
        cost: LinearStepCost | None,
    ) -> None:
        """`cost`: the step-cost model the step-time cap and the drafts' break-even share read (None: no
        cap, and `min_acceptance` as set)."""
        self.config = config
        self.table = table
        self.kv = kv
        self.prefill = prefill
        self.decode = decode
        self.proposer = proposer
        self.cost = cost
        self.policy = POLICY_PLANNERS[config.policy]
        self.by_priority = config.scheduling_policy == "priority"
        self.cap = (
            StepTimeCap(cost, config.max_step_s, config.min_prefill_share, config.prefill_budget)
            if cost is not None and config.max_step_s
            else None
        )
        # The share of a draft's tokens that must be accepted for it to pay (from `cost` before each
        # proposal when there is one): a request whose draft got no more backs off; 1 or more: no draft
        # pays, none is proposed. 0: every draft with a token accepted pays (simulate, tests).
        self.min_acceptance = 0.0

    # ------------------------------------------------------------------ what a step carries
    def decode_load(self) -> StepShape:
        """The decode rows' shape next step: what a step carries besides prefill. A row of width k after
        p cached tokens pairs k * p + k * (k + 1) / 2 (`shared.step_features`)."""
        view = self.decode.batch_view()
        return step_shape(
            self.table.kv_len[view.slots], view.widths, self.cost.windows if self.cost is not None else ()
        )

    def has_prefill_work(self) -> bool:
        """Requests wait, or an admitted prompt has chunks left: a step would carry prefill."""
        return bool(self.prefill.pending_list) or bool(self.prefill.chunking)

    def prefill_prefix(self) -> int:
        """Tokens of its prompt the next prefill chunk follows (the attention it pays for): the first
        mid-chunk request's; 0 for a new admission (its cached prefix is looked up only as it is admitted)."""
        chunking = self.prefill.chunking
        return chunking[0].prefilled if chunking else 0

    # ------------------------------------------------------------------ planning
    def propose_drafts(self) -> None:
        """Speculative decoding: a draft for each decoding request that may have one, is not backing
        off, and has room (`draft_room`). Only while nothing is in flight (every last token is back):
        the caller checks."""
        proposer = self.proposer
        if proposer is None:
            return
        if self.cost is not None:
            self.min_acceptance = self.cost.min_acceptance(self.decode_load())
        if self.min_acceptance >= 1.0:
            return
        table = self.table
        for request in self.decode.running.values():
            if not request.params.speculative or request.draft.shape[0]:
                continue
            if request.spec_pause:
                request.spec_pause -= 1
                continue
            slot = request.slot
            room = self.draft_room(slot)
            if room < 1:
                continue
            generated = int(table.generated[slot])
            draft = proposer.propose(
                np.concatenate([request.client_prompt, table.output_ids[slot, :generated]]), room, request.rid
            )
            if draft.shape[0]:
                self.decode.set_draft(request, draft)

    def draft_room(self, slot: int) -> int:
        """The most draft tokens the slot's next row may carry: its row of 1 + draft stays one token below
        its token limit (SCHEDULING.md 6.4), and a short request's row ends before a rope's switch (the
        request is recomputed there, SCHEDULING.md 5)."""
        t, switch = self.table, self.config.rope_switch_length
        room = int(t.token_limit[slot] - t.generated[slot]) - 2
        if switch and t.prompt_len[slot] <= switch:
            room = min(room, switch - 1 - int(t.kv_len[slot]))
        return room

    def prompt_cap(self, prefill_tokens: int | None) -> int | None:
        """This step's prompt-token cap: the caller's, else the step-time cap's (None: the budget alone)."""
        if prefill_tokens is not None or self.cap is None:
            return prefill_tokens
        return self.cap.prompt_tokens(self)

    def plan(self, cap: int | None) -> PlannedStep:
        """Step 3 under the policy, within the budget and `cap`; then what step 3b would preempt for it,
        dropping every draft first if that avoids it (a draft never costs a preemption)."""
        budget = self.config.prefill_budget
        planned = PlannedStep(
            self.policy(self.prefill, self.decode, budget, budget if cap is None else cap), self.kv, self.by_priority
        )
        if planned.victims and self.decode.drafting:
            self.decode.clear_drafts()
            planned = self.replan(planned.plan.without_drafts())
        return planned

    def replan(self, plan: StepPlan) -> PlannedStep:
        return PlannedStep(plan, self.kv, self.by_priority)

    def predicted_s(self, planned: PlannedStep) -> float | None:
        """The step's time as the cost model predicts it, while the step-time cap is on (else None)."""
        if self.cap is None:
            return None
        return self.cap.cost.predict(self.cap.cost.shape(self.table.kv_len[planned.slots], planned.tokens))
