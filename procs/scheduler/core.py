"""The continuous-batching scheduler of the chapter, as exact rules in `../shared/SCHEDULING.md` (the
team folder beside this checkout).

One `step()` is the chapter's iteration (section 4.2): new requests and aborts have already been
taken in by `add_request` / `abort`; the policy chooses a batch (prefill chunks and/or decodes);
requests whose KV estimate proved short are preempted (step 3b); the executor runs the batch; the
results are applied (tokens appended, stop conditions checked, and finished requests give back
their slot and every KV page in the same step).

A step is two halves, `launch` (plan and pack the batch) and `complete` (apply its tokens), so that
the server can overlap them (mini-sglang, SGLang): it launches step N+1 before step N's tokens are
back, and the worker never waits for the scheduler. `step()` runs the halves back to back, which is
the chapter's schedule exactly (`simulate`'s traces).

The pieces: `PrefillManager` plans chunks and admissions within the budget, `DecodeManager` holds
the decode set, `KVManager` owns the pages (reservation, preemption victims, allocation) and
`batch.build_forward_batch` packs the plan for the worker; the policy (`managers.POLICY_PLANNERS`)
chooses the batch. This module runs the step and applies what came back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from procs.scheduler.batch import StepPlan, build_forward_batch
from procs.scheduler.config import SchedulerConfig
from procs.scheduler.executor import Executor, ExecutorError
from procs.scheduler.kv_manager import KVManager
from procs.scheduler.managers import POLICY_PLANNERS, DecodeManager, PrefillManager
from procs.scheduler.request import Request
from procs.scheduler.request_table import RequestTable
from shared.config import request_cap
from shared.messages import FUTURE_TOKEN, PLAIN_LOGITS, ForwardBatch, LogitsParams, SamplingParams, StepResult, StopParams, TokenLogprobs

_INT32_MAX = 2**31 - 1


class RequestRejectedError(ValueError):
    """`add_request` refused a request; `status` is the HTTP status the api should answer with."""

    def __init__(self, rid: str, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(f"request {rid!r}: {message}")
        self.rid = rid
        self.status = status
        self.param = param


class StepOutput(msgspec.Struct, kw_only=True):
    """What one step did. `cancelled`: requests aborted since the previous step (already freed)."""

    step: int
    prefill: list[tuple[str, int]] = []  # (rid, prompt tokens processed), batch order
    decode: list[str] = []  # admission order
    finished: list[str] = []
    cancelled: list[str] = []
    new_tokens: list[tuple[str, int]] = []  # (rid, token id), batch order; stop tokens included
    finish_reasons: dict[str, str] = {}  # rid -> "stop" | "length"
    batch_size: int = 0  # requests in the executed batch; 0: idle step
    preempted: list[str] = []  # back in the waiting queue (step 3b), in preemption order
    cached_tokens: dict[str, int] = {}  # rid -> prompt tokens found in the prefix cache, with its first token
    logprobs: dict[str, TokenLogprobs] = {}  # rid -> its new token's logprobs (requests that asked)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}  # rid -> prompt tokens 1.., with its first token


_NO_ROWS = np.zeros(0, dtype=np.int64)


class LaunchedStep(NamedTuple):
    """A step between `Scheduler.launch` and `Scheduler.complete`: its plan and batch (None: nothing
    to run), what it did so far, and for each sampling row in batch order the slot, request, index of
    the token in the request's output, and the admission that launched it."""

    plan: StepPlan
    batch: ForwardBatch | None
    out: StepOutput
    sample_slots: np.ndarray = _NO_ROWS
    sample_rids: list[str] = []
    token_index: np.ndarray = _NO_ROWS
    admit_seq: np.ndarray = _NO_ROWS
    completing: list[Request] = []


class Scheduler:
    """Waiting queue, running set, request table and KV pages; plans and applies one step at a time.

    Not thread-safe: call everything from one thread. `abort()` takes effect immediately (the
    request's slot and pages are free on return); called from inside `executor.execute` it is
    deferred to the end of that step.
    """

    def __init__(self, config: SchedulerConfig, *, eos_token_ids: Collection[int] = ()) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.page_size = config.page_size
        self.num_kv_pages = config.num_kv_pages
        self.eos_token_ids = np.asarray(sorted(set(eos_token_ids)), dtype=np.int64)
        self.table = RequestTable(config.max_running_requests, self.max_pages_per_request)
        self.kv = KVManager(config, self.table)
        self.allocator = self.kv.allocator
        self.prefill_manager = PrefillManager(self.table, self.kv)
        self.decode_manager = DecodeManager()
        self._planner = POLICY_PLANNERS[config.policy]
        self._live: dict[str, Request] = {}  # waiting + admitted, by rid
        self._step = 0
        self._cancelled: list[str] = []
        self._in_step = False
        self._deferred_aborts: list[str] = []
        self._launched = 0  # launched steps not completed yet

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
    def kv_reserved_tokens(self) -> int:
        """KV positions the admitted requests hold or have reserved (may exceed capacity when rho < 1)."""
        return self.kv.reserved_pages() * self.page_size

    @property
    def num_pool_pages(self) -> int:
        """Pages the worker's KV pool must have: the usable ones plus dummy page 0."""
        return self.num_kv_pages + 1

    @property
    def max_pages_per_request(self) -> int:
        """Page-table width the worker needs (columns per request slot)."""
        if self.config.max_context:
            return min(self.num_kv_pages, -(-self.config.max_context // self.page_size))
        return self.num_kv_pages

    def has_unfinished(self) -> bool:
        """True while requests wait or run, or aborts are still to be reported by a `step()`."""
        return bool(self._live) or bool(self._cancelled)

    def decode_load(self) -> tuple[int, float]:
        """(requests decoding, their attention pairs next step): what a step carries besides prefill."""
        slots = self.decode_manager.batch_view()[0]
        return int(slots.shape[0]), float(self.table.kv_len[slots].sum() + slots.shape[0])

    def prefill_prefix(self) -> int:
        """Tokens of its prompt the next prefill chunk follows (the attention it pays for): the first
        mid-chunk request's; 0 for a new admission (its cached prefix is looked up only as it is admitted)."""
        chunking = self.prefill_manager.chunking
        return chunking[0].prefilled if chunking else 0

    def rid_in_slot(self, slot: int) -> str | None:
        request = self.table.requests[slot]
        return None if request is None else request.rid

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, rid: str, prompt_ids: Sequence[int] | np.ndarray, sampling: SamplingParams,
                    stop: StopParams, logits: LogitsParams = PLAIN_LOGITS) -> None:
        """Queue a request at the tail of the waiting queue, or raise `RequestRejectedError`."""
        if rid in self._live:
            raise RequestRejectedError(rid, "a request with this id is already queued or running")
        prompt = self._validate_prompt(rid, prompt_ids)
        # max_tokens is settled (>= 1, within the context) by the tokenizer: the scheduler trusts it.
        max_tokens = stop.max_tokens
        assert max_tokens is not None, "max_tokens is settled by the tokenizer before a request gets here"
        total = prompt.shape[0] + max_tokens
        if self.kv.pages_for(total) > self.num_kv_pages:
            raise RequestRejectedError(
                rid, f"prompt ({prompt.shape[0]} tokens) + max_tokens ({max_tokens}) = {total} can never fit "
                f"in the KV cache of {self.kv_capacity_tokens} tokens", param="max_tokens")
        capacity = request_cap(self.config.max_running_requests, self.config.max_waiting)
        if capacity is not None and len(self._live) >= capacity:
            raise RequestRejectedError(
                rid, f"the server is full ({self.config.max_running_requests} running + {self.config.max_waiting} "
                f"waiting requests)", status=503)
        banned = (() if stop.ignore_eos else tuple(self.eos_token_ids.tolist())) + tuple(stop.stop_token_ids)
        request = Request(rid, prompt, sampling, stop, logits, banned)
        self._live[rid] = request
        self.prefill_manager.pending_list.append(request)

    def abort(self, rid: str) -> bool:
        """Cancel `rid`, freeing its slot and KV pages now; reported in the next `StepOutput.cancelled`.

        False if it is unknown or already ended. Called from inside `executor.execute`, it is applied
        when that step ends (True is returned at once; if the request finishes in that very step, the
        step reports it finished and no cancellation follows).
        """
        request = self._live.get(rid)
        if request is None:
            return False
        if self._in_step:
            self._deferred_aborts.append(rid)
            return True
        if request.slot < 0:
            self.prefill_manager.pending_list.remove(request)
            del self._live[rid]
        else:
            self._release([request])
        self._cancelled.append(rid)
        return True

    # ------------------------------------------------------------------ one iteration
    def step(self, executor: Executor, prefill_tokens: int | None = None) -> StepOutput:
        """Choose a batch by the policy, preempt if its pages do not fit, execute it, apply the results.

        `prefill_tokens`: at most this many prompt tokens this step, below `prefill_budget` (the
        server's step-time bound; None: the budget alone, as in SCHEDULING.md). Idle steps still count."""
        self._in_step = True
        try:
            launched = self.launch(prefill_tokens)
            if launched.batch is not None:
                self.complete(launched, executor.execute(launched.batch))
        finally:
            self._in_step = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            for rid in deferred:
                self.abort(rid)
        return launched.out

    def launch(self, prefill_tokens: int | None = None, *,
               drain: Callable[[], None] | None = None) -> LaunchedStep:
        """The first half of a step: plan, preempt, allocate, pack the batch, and advance every count the
        batch decides (KV positions, prefill progress, tokens sampled, the decode set). `complete` applies
        the sampled tokens when they come back.

        Overlap scheduling calls this while earlier launched steps are still running: a decode whose last
        token is not back yet is fed `FUTURE_TOKEN`, which the worker replaces by the token it sampled last
        for that slot. A request the running steps may still finish stays planned; its extra row is
        dropped when it comes back. Preemption needs every token known (a victim's tokens become its
        prompt): if this step must preempt while steps run, `drain` is called first to complete them.
        """
        out = StepOutput(step=self._step, cancelled=self._cancelled)
        self._step += 1
        self._cancelled = []
        plan = self._plan(prefill_tokens)
        slots, tokens = plan.slots_and_tokens()
        growth = self.kv.growth(slots, tokens)
        victims = self.kv.preemption_victims(slots, growth)
        if victims and self._launched:
            if drain is None:
                raise RuntimeError("preempting while steps are in flight needs a drain")
            drain()
            plan = plan.without([s for s, rid in zip(plan.decode_slots.tolist(), plan.decode_rids)
                                 if rid not in self._live])  # finished by the drained steps
            slots, tokens = plan.slots_and_tokens()
            growth = self.kv.growth(slots, tokens)
            victims = self.kv.preemption_victims(slots, growth)
        if victims:
            plan = plan.without(victims)
            out.preempted = self._preempt(victims)
            slots, tokens = plan.slots_and_tokens()
            growth = self.kv.growth(slots, tokens)
        if plan.is_empty:
            return LaunchedStep(plan, None, out)
        updates = self.kv.allocate(slots, growth)
        batch = build_forward_batch(out.step, plan, updates, self.table, self.page_size)
        self._launched += 1
        return self._advance(plan, batch, out)

    # ------------------------------------------------------------------ planning
    def _plan(self, prefill_tokens: int | None) -> StepPlan:
        budget = self.config.prefill_budget
        cap = budget if prefill_tokens is None else prefill_tokens
        return self._planner(self.prefill_manager, self.decode_manager, budget, cap)

    def _preempt(self, slots: list[int]) -> list[str]:
        """Step 3b: free the requests' slots and KV; they wait again to recompute what they had."""
        table = self.table
        requests: list[Request] = [table.requests[s] for s in slots]  # type: ignore[misc]  # admitted: not None
        generated = [table.output_ids[s, :table.generated[s]].copy() for s in slots]
        self._release(requests, forget=False)
        for request, tokens in zip(requests, generated):
            request.recompute_with(tokens)
            self.prefill_manager.requeue(request)
        return [r.rid for r in requests]

    def _advance(self, plan: StepPlan, batch: ForwardBatch, out: StepOutput) -> LaunchedStep:
        """Advance what a launched batch decides, before its tokens are known (see `launch`)."""
        table = self.table
        ds = plan.decode_slots
        if ds.shape[0]:
            table.kv_len[ds] += 1
        completing: list[Request] = []
        if plan.prefill:
            table.kv_len[plan.prefill_slots] += np.asarray([n for _, n in plan.prefill], dtype=np.int64)
            for request, n in plan.prefill:
                request.prefilled += n
                self.kv.cache_prompt_pages(request)  # the worker computes them before any later step reads them
                if request.prefilled == request.prompt_len:
                    completing.append(request)
        if completing:
            cslots = np.fromiter((r.slot for r in completing), dtype=np.int64, count=len(completing))
            sample_slots = np.concatenate([ds, cslots])
            sample_rids = plan.decode_rids + [r.rid for r in completing]
            out.cached_tokens = {r.rid: r.cached_tokens for r in completing
                                 if r.cached_tokens and r.num_generated_before == 0}
        else:
            sample_slots, sample_rids = ds, plan.decode_rids
        token_index = table.generated[sample_slots].copy()
        table.generated[sample_slots] += 1
        table.last_token[sample_slots] = FUTURE_TOKEN
        # A request whose token limit this step reaches leaves the decode set now (it is released when
        # the token comes back), so no step launched meanwhile plans it.
        at_limit = table.generated[sample_slots] >= table.token_limit[sample_slots]
        nd = ds.shape[0]
        for i in np.flatnonzero(at_limit[:nd]).tolist():
            self.decode_manager.remove(sample_rids[i])
        if completing:
            self.prefill_manager.chunking = [r for r in self.prefill_manager.chunking if r.prefilled < r.prompt_len]
            for request, limited in zip(completing, at_limit[nd:].tolist()):
                if not limited:
                    self.decode_manager.add(request)
        out.prefill = [(r.rid, n) for r, n in plan.prefill]
        out.decode = list(plan.decode_rids)
        out.batch_size = batch.num_requests
        return LaunchedStep(plan, batch, out, sample_slots, sample_rids, token_index,
                            table.admit_seq[sample_slots].copy(), completing)

    # ------------------------------------------------------------------ applying results
    def complete(self, launched: LaunchedStep, result: StepResult) -> StepOutput:
        """The second half of a step: record the sampled tokens, check stop conditions, and release the
        requests that finished (their slot and every KV page). Rows of requests that ended while the
        step ran (finished by an earlier step's token, or aborted) are dropped."""
        batch, out = launched.batch, launched.out
        assert batch is not None, "an empty step has nothing to complete"
        self._launched -= 1
        table = self.table
        token_ids = np.asarray(result.next_token_ids)
        num_sampling = launched.sample_slots.shape[0]
        if result.step != batch.step or token_ids.shape != (num_sampling,):
            raise ExecutorError(
                f"step {batch.step}: expected {num_sampling} token ids for step {batch.step}, got "
                f"shape {token_ids.shape} for step {result.step}")
        slots, rids, index = launched.sample_slots, launched.sample_rids, launched.token_index
        live = table.admit_seq[slots] == launched.admit_seq  # still the admission that launched the row
        if not live.all():
            keep = np.flatnonzero(live)
            slots, index, token_ids = slots[keep], index[keep], token_ids[keep]
            rows = keep.tolist()
            rids = [rids[i] for i in rows]
        else:
            rows = list(range(num_sampling))
        table.output_ids[slots, index] = token_ids
        latest = table.generated[slots] == index + 1  # no later step has fed this slot yet
        table.last_token[slots[latest]] = token_ids[latest]
        reached_limit = index + 1 >= table.token_limit[slots]
        if self.eos_token_ids.shape[0] == 1:
            stopped = (token_ids == self.eos_token_ids[0]) & table.check_eos[slots]
        elif self.eos_token_ids.shape[0]:
            stopped = np.isin(token_ids, self.eos_token_ids) & table.check_eos[slots]
        else:
            stopped = np.zeros(slots.shape[0], dtype=bool)
        for i in np.flatnonzero(table.has_stop_ids[slots]).tolist():
            if int(token_ids[i]) in table.requests[int(slots[i])].stop_ids:
                stopped[i] = True

        out.new_tokens = list(zip(rids, token_ids.tolist()))
        if result.logprobs:
            position = {row: i for i, row in enumerate(rows)}
            out.logprobs = {rids[position[row]]: lp for row, lp in zip(result.logprob_rows, result.logprobs)
                            if row in position}
        prefilling = {r.slot: r for r, _ in launched.plan.prefill}
        for slot, entries in result.prompt_logprobs:
            request = prefilling[slot]
            if self._live.get(request.rid) is request and request.slot == slot:
                request.prompt_logprobs.extend(entries)
        out.prompt_logprobs = {r.rid: r.prompt_logprobs for r in launched.completing
                               if r.wants_prompt_logprobs and self._live.get(r.rid) is r}
        done = np.flatnonzero(stopped | reached_limit).tolist()
        if done:
            out.finished = [rids[i] for i in done]
            out.finish_reasons = {rids[i]: "stop" if stopped[i] else "length" for i in done}
            self._release([self._live[rid] for rid in out.finished])
        return out

    def _release(self, requests: list[Request], *, forget: bool = True) -> None:
        """Give back the slots and every KV page of admitted requests (and forget them: they ended)."""
        for request in requests:
            if request.prefilled < request.prompt_len:
                self.prefill_manager.chunking.remove(request)
            elif request.rid in self.decode_manager:  # not when its token limit is reached (see _advance)
                self.decode_manager.remove(request.rid)
            if forget:
                del self._live[request.rid]
        self.kv.release(requests)
        for request in requests:
            request.slot = -1

    @staticmethod
    def _validate_prompt(rid: str, prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        try:
            prompt = np.asarray(prompt_ids)
        except (TypeError, ValueError) as exc:
            raise RequestRejectedError(rid, f"prompt token ids are not a sequence of integers ({exc})",
                                       param="prompt") from None
        if prompt.ndim != 1:
            raise RequestRejectedError(rid, f"prompt token ids must be one-dimensional, got shape {prompt.shape}",
                                       param="prompt")
        if prompt.shape[0] == 0:
            raise RequestRejectedError(rid, "the prompt is empty", param="prompt")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise RequestRejectedError(rid, f"prompt token ids must be integers, got {prompt.dtype}", param="prompt")
        if int(prompt.min()) < 0 or int(prompt.max()) > _INT32_MAX:
            raise RequestRejectedError(rid, "prompt token ids must be in [0, 2**31)", param="prompt")
        return prompt.astype(np.int32, copy=True)

