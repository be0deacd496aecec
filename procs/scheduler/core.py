"""The continuous-batching scheduler of the chapter, as exact rules in `SCHEDULING.md` (beside this
module).

One `step()` is the chapter's iteration (section 4.2): new requests and aborts have already been
taken in by `add_request` / `abort`; the policy chooses a batch (prefill chunks and/or decodes);
requests whose KV estimate proved short are preempted (step 3b); the executor runs the batch; the
results are applied (tokens appended, stop conditions checked, and finished requests give back
their slot and every KV page in the same step).

A step is two halves, `launch` (plan and pack the batch) and `complete` (apply its tokens), so that
the server can overlap them (mini-sglang, SGLang): it launches step N+1 before step N's tokens are
back, and the worker never waits for the scheduler. `step()` runs the halves back to back, which is
the chapter's schedule exactly (`simulate`'s traces).

A decode row feeds its request's last token and then its draft, if it has one (`set_draft`): a row of
width k adds k KV positions, samples k tokens and counts k against the prefill budget. Every token
that comes back is appended in order with the stop checks applied to each; the first that ends the
request drops the rest of its row. A draft is taken only while no step is in flight: its row's
verification decides where the request's next row starts, so no step launches behind it.

Speculative decoding (`speculative="ngram"` or `"draft"`) gives drafts to decoding requests before each
step that nothing is in flight for (`NgramProposer`, or `DraftPlaceholders` that the worker's draft
model fills), and the worker verifies them
(`StepResult.accepted_lens`): only a row's accepted tokens are appended, and the rest of its row is
rolled back (its KV positions, its generated count, and the pages past its KV). A draft never takes
a row to its token limit, so that a rejection never has to put its request back in the decode set.

The pieces: `PrefillManager` plans chunks and admissions within the budget, `DecodeManager` holds
the decode set, `KVManager` owns the pages (reservation, preemption victims, allocation) and
`batch.build_forward_batch` packs the plan for the worker; the policy (`managers.POLICY_PLANNERS`)
chooses the batch. `step_launch` records what a launched batch decides, `step_results` reads the tokens
that come back, and `input_checks` checks what comes in from outside (requests, drafts, step results).
This module runs the step as stages and applies what came back; the features (windows, drafts, the pooling
runner's vectors, failed grammars) join at the hooks of `step_hooks`, registered by `features`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from batchserve.procs.scheduler.batch import build_forward_batch
from batchserve.procs.scheduler.config import SchedulerConfig
from batchserve.procs.scheduler.deltas import token_deltas
from batchserve.procs.scheduler.executor import Executor
from batchserve.procs.scheduler.features import register_features
from batchserve.procs.scheduler.input_checks import checked_draft, checked_prompt, checked_result
from batchserve.procs.scheduler.kv_manager import KVManager
from batchserve.procs.scheduler.managers import DecodeManager, PrefillManager
from batchserve.procs.scheduler.request import Request, Status
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.procs.scheduler.step_cost import LinearStepCost
from batchserve.procs.scheduler.step_hooks import SchedulerHooks
from batchserve.procs.scheduler.step_launch import advance_launched
from batchserve.procs.scheduler.step_output import KeptTokens, LaunchedStep, StepOutput
from batchserve.procs.scheduler.step_planning import PlannedStep, Proposer, StepPlanner, default_proposer
from batchserve.procs.scheduler.step_results import kept_tokens, record_logprobs, settle_rows
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import DEFAULT_PARAMS, RequestParams, StepResult, TokenDelta
from batchserve.shared.step_features import StepShape


class Scheduler:
    """Waiting queue, running set, request table and KV pages; plans and applies one step at a time.

    Not thread-safe: call everything from one thread. `abort()` takes effect immediately (the
    request's slot and pages are free on return); called from inside `executor.execute` it is
    deferred to the end of that step.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        eos_token_ids: Collection[int] = (),
        proposer: Proposer | None = None,
        cost: LinearStepCost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`proposer`: where drafts come from (default: `step_planning.default_proposer`). `cost`: the
        step-cost model of the step-time bound (`config.max_step_s`) and of the drafts' break-even
        share; `clock`: the queue times' (seconds)."""
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.num_kv_pages = config.num_kv_pages
        self.eos_token_ids = np.asarray(sorted(set(eos_token_ids)), dtype=np.int64)
        self._eos_tuple = tuple(self.eos_token_ids.tolist())
        self.table = RequestTable(config.max_running_requests, self.max_pages_per_request)
        self.kv = KVManager(config, self.table)
        self.allocator = self.kv.allocator
        self.by_priority = config.scheduling_policy == "priority"
        self.prefill_manager = PrefillManager(
            self.table,
            self.kv,
            by_priority=self.by_priority,
            fair=config.fair_prefill,
            max_loras=config.max_loras,
            whole=config.whole_prompts,
        )
        self.decode_manager = DecodeManager()
        self.planner = StepPlanner(
            config,
            self.table,
            self.kv,
            self.prefill_manager,
            self.decode_manager,
            proposer if proposer is not None else default_proposer(config),
            cost,
        )
        self.clock = clock
        # The one table of requests by rid, from arrival until they end (the managers and the request
        # table hold the same `Request`s by position or slot); `Request.status` says where each is.
        self.requests: dict[str, Request] = {}
        self._step = 0
        self._cancelled: list[Request] = []  # aborted since the last launched step
        self._in_step = False
        self._deferred_aborts: list[str] = []
        self._launched = 0  # launched steps not completed yet
        # A launched step has a row wider than one token: its verification decides where the request's
        # next row starts, so it must complete before the next launch.
        self._wide_rows_in_flight = False
        self._arrivals = 0  # arrival sequence numbers (the waiting queue's order among equal priorities)
        self.hooks = SchedulerHooks()  # the features at the step's hooks (`procs.scheduler.step_hooks`)
        register_features(self)

    @property
    def steps_out_of_reach(self) -> int:
        """Steps with prefill work whose decodes alone were predicted over the step-time target."""
        return self.planner.cap.steps_out_of_reach if self.planner.cap is not None else 0

    # ------------------------------------------------------------------ public state
    @property
    def num_waiting(self) -> int:
        return len(self.prefill_manager.pending_list)

    @property
    def num_running(self) -> int:
        """Admitted requests (slots in use), including those still mid-chunk in prefill."""
        return self.table.num_used

    @property
    def kv_used_tokens(self) -> int:
        """KV positions held for running requests (their own pages and the cached pages they use);
        cached pages nobody uses are free to evict and not counted."""
        evictable = self.kv.cache.num_evictable if self.kv.cache is not None else 0
        return (self.allocator.num_used - evictable) * self.page_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_pages * self.page_size

    @property
    def num_pool_pages(self) -> int:
        """Pages the worker's KV pool must have: the usable ones plus dummy page 0."""
        return self.num_kv_pages + 1

    @property
    def max_pages_per_request(self) -> int:
        """Page-table width the worker needs (columns per request slot): the context's pages, at most the
        pool's, unless a sliding window gives pages back (then a request spans more pages than it holds)."""
        if self.config.max_context:
            columns = -(-self.config.max_context // self.page_size)
            return columns if self.config.sliding_window else min(self.num_kv_pages, columns)
        return self.num_kv_pages

    def has_unfinished(self) -> bool:
        """True while requests wait or run, or aborts are still to be reported by a `step()`."""
        return bool(self.requests) or bool(self._cancelled)

    def decode_load(self) -> StepShape:
        """The decode rows' shape next step: `StepPlanner.decode_load`."""
        return self.planner.decode_load()

    def rid_in_slot(self, slot: int) -> str | None:
        request = self.table.requests[slot]
        return None if request is None else request.rid

    # ------------------------------------------------------------------ requests in and out
    def add_request(
        self, rid: str, prompt_ids: Sequence[int] | np.ndarray, params: RequestParams = DEFAULT_PARAMS
    ) -> None:
        """Queue a request (at the tail of the waiting queue; by `params.priority` under the priority
        policy), or raise `Refusal`. `params.speculative` False: never give it a draft."""
        if rid in self.requests:
            raise Refusal("a request with this id is already queued or running")
        prompt = checked_prompt(
            self.config,
            self.kv,
            prompt_ids,
            params,
            max_pages_per_request=self.max_pages_per_request,
            num_requests=len(self.requests),
        )
        request = Request(rid, prompt, params, arrival=self._arrivals)
        request.arrived_s = self.clock()
        self._arrivals += 1
        self.requests[rid] = request
        self.prefill_manager.enqueue(request)

    def abort(self, rid: str) -> bool:
        """Cancel `rid`, freeing its slot and KV pages now; reported in the next `StepOutput.cancelled`.

        False if it is unknown or already ended. Called from inside `executor.execute`, it is applied
        when that step ends (True is returned at once; if the request finishes in that very step, the
        step reports it finished and no cancellation follows).
        """
        request = self.requests.get(rid)
        if request is None:
            return False
        if self._in_step:
            self._deferred_aborts.append(rid)
            return True
        self._end([request], Status.CANCELLED)
        self._cancelled.append(request)
        return True

    def set_draft(self, rid: str, draft: Sequence[int] | np.ndarray) -> None:
        """Give decoding request `rid` tokens proposed to follow its last token: its next decode row feeds
        them after it and samples one token at each (ValueError if it cannot take them).

        Only while no step is in flight (its last token is back, and the verification of the row decides
        where the next row starts); and at most its token limit less two tokens, so that the row stays
        below the limit (a rejection never has to put the request back in the decode set)."""
        request = self.requests.get(rid)
        if request is None or request.slot not in self.decode_manager:
            raise ValueError(f"request {rid!r} is not decoding")
        tokens = checked_draft(draft)
        if self._launched:
            raise ValueError(f"request {rid!r}: its last token is not back yet (a step is in flight)")
        room = self.planner.draft_room(request.slot)
        if tokens.shape[0] > room:
            raise ValueError(
                f"request {rid!r}: a draft of {tokens.shape[0]} tokens passes its token limit (room for {room})"
            )
        self.decode_manager.set_draft(request, tokens.astype(np.int32))

    def token_deltas(self, out: StepOutput) -> list[TokenDelta]:
        """`out` as one `TokenDelta` per request, for the detokenizer (see `procs.scheduler.deltas`)."""
        return token_deltas(out, self.requests)

    # ------------------------------------------------------------------ one iteration
    def step(self, executor: Executor, prefill_tokens: int | None = None) -> StepOutput:
        """Choose a batch by the policy, preempt if its pages do not fit, execute it, apply the results.

        `prefill_tokens`: at most this many prompt tokens this step, below `prefill_budget` (the
        server's step-time bound; None: the budget alone, as in SCHEDULING.md). Idle steps still count."""
        self._in_step = True
        out = None
        try:
            launched = self.launch(prefill_tokens)
            out = launched.out
            if launched.batch is not None:
                self.complete(launched, executor.execute(launched.batch))
        finally:
            self._in_step = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            for rid in deferred:
                if out is not None and rid in self.requests:  # this step's delta of it reads it, once forgotten
                    out.ended.setdefault(rid, self.requests[rid])
                self.abort(rid)
        return launched.out

    def launch(self, prefill_tokens: int | None = None, *, drain: Callable[[], None] | None = None) -> LaunchedStep:
        """The first half of a step: plan, preempt, allocate, pack the batch, and advance every count the
        batch decides (KV positions, prefill progress, tokens sampled, the decode set). `complete` applies
        the sampled tokens when they come back. Its stages and hooks: `procs.scheduler.step_hooks`.

        Overlap scheduling calls this while earlier launched steps are still running: a decode whose last
        token is not back yet is fed `FUTURE_TOKEN`, which the worker replaces by the token it sampled last
        for that slot. A request the running steps may still finish stays planned; its extra row is
        dropped when it comes back. Preemption needs every token known (a victim's tokens become its
        prompt): if this step must preempt while steps run, `drain` is called first to complete them.
        """
        out = self._open_step()
        self.hooks.run_before_plan(out, drain)
        planned = self._plan_step(out, prefill_tokens, drain)
        if planned.plan.is_empty:
            return LaunchedStep(planned.plan, None, out)
        return self._pack_step(out, planned)

    @property
    def steps_in_flight(self) -> int:
        """Launched steps not completed yet."""
        return self._launched

    def _open_step(self) -> StepOutput:
        """A new step's output, with the aborts since the last one."""
        if self._wide_rows_in_flight:
            raise RuntimeError(
                "a step with rows wider than one token is in flight: complete it before launching "
                "another (speculative decoding needs overlap scheduling off)"
            )
        out = StepOutput(step=self._step)
        if self._cancelled:
            out.cancelled = [r.rid for r in self._cancelled]
            out.ended = {r.rid: r for r in self._cancelled}
            self._cancelled = []
        self._step += 1
        return out

    def _plan_step(self, out: StepOutput, prefill_tokens: int | None, drain: Callable[[], None] | None) -> PlannedStep:
        """The policy's plan within the step's prefill cap, its pages fitted (step 3b), first admissions'
        queue times noted, and its predicted time under the step-time bound."""
        planner = self.planner
        out.prefill_cap = prefill_tokens if planner.cap is None else planner.prompt_cap(prefill_tokens)
        planned = self._fit_pages(planner.plan(out.prefill_cap), out, drain)
        if self.prefill_manager.first_admissions:
            self._take_first_admissions(out)
        if planner.cap is not None and not planned.plan.is_empty:
            out.predicted_s = planner.predicted_s(planned)
        return planned

    def _pack_step(self, out: StepOutput, planned: PlannedStep) -> LaunchedStep:
        """Allocate the planned step's pages, pack its batch, and advance what it decides."""
        plan = planned.plan
        updates = self.kv.allocate(planned.slots, planned.growth)
        batch = build_forward_batch(out.step, plan, updates, self.table, self.page_size, self._eos_tuple)
        self._launched += 1
        # rows wider than one token (a decode row with proposals) decide where their request's next row starts
        self._wide_rows_in_flight = bool(plan.decode_slots.shape[0]) and self.decode_manager.has_wide_rows
        return advance_launched(plan, batch, out, self.table, self.kv, self.prefill_manager, self.decode_manager)

    # ------------------------------------------------------------------ preemption
    def _fit_pages(self, planned: PlannedStep, out: StepOutput, drain: Callable[[], None] | None) -> PlannedStep:
        """Step 3b: preempt what the planned step's pages need (after completing the steps in flight, whose
        tokens a victim's recompute needs and which may free room); the plan without the victims."""
        if planned.victims and self._launched:
            if drain is None:
                raise RuntimeError("preempting while steps are in flight needs a drain")
            drain()
            plan = planned.plan
            planned = self.planner.replan(
                plan.without(
                    [s for s, rid in zip(plan.decode_slots.tolist(), plan.decode_rids) if rid not in self.requests]
                )
            )  # finished by the drained steps
        if planned.victims:
            plan = planned.plan.without(planned.victims)  # before the victims give back their slots
            out.preempted += self._preempt(planned.victims)
            planned = self.planner.replan(plan)
        return planned

    def preempt_for_head(self, out: StepOutput, drain: Callable[[], None] | None) -> None:
        """SCHEDULING.md section 8, before the policy plans: the head of the waiting queue preempts
        admitted requests of a lower priority when that lets it fit (`PrefillManager.victims_for_head`)."""
        victims = self.prefill_manager.victims_for_head()
        if victims and self._launched:
            if drain is None:
                raise RuntimeError("preempting while steps are in flight needs a drain")
            drain()  # the victims' tokens must be known; the drained steps may have freed room
            victims = self.prefill_manager.victims_for_head()
        if victims:
            out.preempted = self._preempt(victims)

    def recompute_at_rope_switch(self, out: StepOutput, drain: Callable[[], None] | None) -> None:
        """A rope that switches factors with the length (longrope), transformers' rule: a sequence that
        grows past the switch has every key recomputed with the long factors (Phi-3's `generate` drops
        its cache there). A decoding request about to compute the switch position is recomputed at
        once, through the preemption path (counted with the preemptions)."""
        switch, table = self.config.rope_switch_length, self.table

        def crossing() -> list[int]:
            running = self.decode_manager.running.items()
            return [slot for slot, request in running if request.prompt_len <= switch <= table.kv_len[slot]]

        slots = crossing()
        if slots and self._launched:
            if drain is None:
                raise RuntimeError("recomputing while steps are in flight needs a drain")
            drain()  # their tokens must be known
            slots = crossing()
        if slots:
            out.preempted += self._preempt(slots)

    def _preempt(self, slots: list[int]) -> list[str]:
        """Free the requests' slots and KV; they wait again to recompute what they had."""
        table = self.table
        requests: list[Request] = [table.requests[s] for s in slots]  # type: ignore[misc]  # admitted: not None
        generated = [table.output_ids[s, : table.generated[s]].copy() for s in slots]
        self._free(requests)
        for request, tokens in zip(requests, generated):
            request.recompute_with(tokens)
            self.prefill_manager.requeue(request)
        return [r.rid for r in requests]

    def _take_first_admissions(self, out: StepOutput) -> None:
        admitted = self.prefill_manager.first_admissions
        if admitted:
            now = self.clock()
            out.queue_times = [now - r.arrived_s for r in admitted]
            admitted.clear()

    # ------------------------------------------------------------------ applying results
    def complete(self, launched: LaunchedStep, result: StepResult) -> StepOutput:
        """The second half of a step: record the sampled tokens, check stop conditions, and release the
        requests that finished (their slot and every KV page). Rows of requests that ended while the
        step ran (finished by an earlier step's token, or aborted) are dropped, and so are a row's
        tokens after the one that ends its request. Its stages and hooks: `procs.scheduler.step_hooks`."""
        assert launched.batch is not None, "an empty step has nothing to complete"
        self._launched -= 1
        self._wide_rows_in_flight = False
        kept = self._record_tokens(launched, result)
        record_logprobs(self.requests, launched, result, kept)
        self.hooks.run_on_tokens(launched, result, kept)
        self._finish_ended(kept, launched.out)
        self.hooks.run_after_complete(launched.out, result)
        return launched.out

    def _record_tokens(self, launched: LaunchedStep, result: StepResult) -> KeptTokens:
        """The step's tokens that count, settled into their rows and written to the request table."""
        table, out, batch = self.table, launched.out, launched.batch
        assert batch is not None
        token_ids, accepted = checked_result(batch, launched, result)
        one_per_row = token_ids.shape[0] == launched.sample_slots.shape[0]  # no slot has two tokens
        kept = kept_tokens(table, self.eos_token_ids, launched, token_ids, accepted)
        if not one_per_row:  # a row of one token keeps it: nothing to settle
            settle_rows(table, self.kv, launched, kept, out, self.planner.min_acceptance)
        slots, index, token_ids = kept.slots, kept.index, kept.token_ids
        table.output_ids[slots, index] = token_ids
        latest = table.generated[slots] == index + 1  # its row's last token, and no later step has fed this slot yet
        table.last_token[slots[latest]] = token_ids[latest]
        out.new_tokens = list(zip(kept.rids, token_ids.tolist()))
        out.token_counts = (index + 1).tolist()
        if one_per_row:
            table.reported[slots] = index + 1
        else:  # a row's tokens are in order: its last one's count
            np.maximum.at(table.reported, slots, index + 1)
        return kept

    def _finish_ended(self, kept: KeptTokens, out: StepOutput) -> None:
        """The requests a kept token ended: finished, with their reason, their slot and pages freed."""
        done = np.flatnonzero(kept.ends).tolist()
        if not done:
            return
        rids = kept.rids
        out.finished = [rids[i] for i in done]
        out.finish_reasons = {rids[i]: "stop" if kept.stopped[i] else "length" for i in done}
        finished = [self.requests[rid] for rid in out.finished]
        out.ended.update(zip(out.finished, finished))
        self._end(finished, Status.FINISHED)

    def end_with_error(self, request: Request, message: str, param: str | None, out: StepOutput) -> None:
        """End a running request with an error for the client (`out.errors`), as a cancellation that frees
        its slot and pages."""
        out.errors[request.rid] = (message, param)
        out.cancelled.append(request.rid)
        out.ended[request.rid] = request
        self._end([request], Status.CANCELLED)

    # ------------------------------------------------------------------ the lifecycle's exits
    def _end(self, requests: list[Request], status: Status) -> None:
        """FINISHED or CANCELLED: the requests leave wherever they are (an admitted one gives back its slot
        and every KV page) and the scheduler forgets them."""
        self._free([r for r in requests if r.status.holds_slot])
        for request in requests:
            if not request.status.holds_slot and not request.status.ended:
                self.prefill_manager.pending_list.remove(request)  # waiting: no slot, no KV
            request.move_to(status)
            del self.requests[request.rid]

    def _free(self, requests: list[Request]) -> None:
        """Admitted requests leave the mid-chunk list or the decode set and give back their slot and pages."""
        for request in requests:
            if request.status is Status.PREFILLING:
                self.prefill_manager.chunking.remove(request)
            elif request.slot in self.decode_manager:  # not once its token limit's step is launched (`step_launch`)
                self.decode_manager.remove(request.slot)
        self.kv.release(requests)
        for request in requests:
            request.slot = -1
