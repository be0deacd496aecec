"""The registration of the scheduler's features at the hooks of its step (`procs.scheduler.step_hooks`):
the one scheduler module that names each of them, run once as the `Scheduler` is built, from its
configuration, in the order the hooks run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.procs.scheduler.step_hooks import Drain
from batchserve.procs.scheduler.step_output import StepOutput
from batchserve.procs.scheduler.step_results import record_pooled
from batchserve.shared.messages import StepResult

if TYPE_CHECKING:
    from batchserve.procs.scheduler.core import Scheduler


def register_features(scheduler: Scheduler) -> None:
    hooks, config, kv, planner = scheduler.hooks, scheduler.config, scheduler.kv, scheduler.planner
    if scheduler.by_priority and config.policy != "fixed":
        hooks.before_plan.append(scheduler.preempt_for_head)
    if config.rope_switch_length:
        hooks.before_plan.append(scheduler.recompute_at_rope_switch)

    def release_behind_windows(out: StepOutput, drain: Drain) -> None:
        kv.drop_out_of_window()

    if kv.window:  # a window every layer shares: the pages behind it go back
        hooks.before_plan.append(release_behind_windows)
    if planner.proposer is not None:

        def propose_drafts(out: StepOutput, drain: Drain) -> None:
            if not scheduler.steps_in_flight:  # a draft follows the last token: it must be back
                planner.propose_drafts()

        hooks.before_plan.append(propose_drafts)
    hooks.on_tokens.append(record_pooled)  # (nothing unless the step's result carries vectors)

    def end_failed_grammars(out: StepOutput, result: StepResult) -> None:
        """End the requests whose grammar failed this step (still running: one that finished in this step
        keeps its end) with an error for the client, as cancellations that free their slot and pages."""
        for slot, error in result.grammar_failures:
            request = scheduler.table.requests[slot]
            if request is None or scheduler.requests.get(request.rid) is not request:
                continue
            param = request.params.logits.grammar_param
            message = f"the output could not be held to {param or 'its constraint'}: {error}"
            scheduler.end_with_error(request, message, param, out)

    hooks.after_complete.append(end_failed_grammars)

    def release_when_idle(out: StepOutput, result: StepResult) -> None:
        if not scheduler.steps_in_flight:  # nothing in flight reads the pages behind a window: give them back
            kv.drop_out_of_window()

    if kv.window:
        hooks.after_complete.append(release_when_idle)
