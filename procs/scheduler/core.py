"""The continuous-batching scheduler of the chapter, as exact rules in `../shared/SCHEDULING.md` (the
team folder beside this checkout).

One `step()` is the chapter's iteration (section 4.2): new requests and aborts have already been
taken in by `add_request` / `abort`; the policy chooses a batch (prefill chunks and/or decodes);
requests whose KV estimate proved short are preempted (step 3b); the executor runs the batch; the
results are applied (tokens appended, stop conditions checked, and finished requests give back
their slot and every KV page in the same step).

The pieces: `PrefillManager` plans chunks and admissions within the budget, `DecodeManager` holds
the decode set, `KVManager` owns the pages (reservation, preemption victims, allocation) and
`batch.build_forward_batch` packs the plan for the worker; the policy (`managers.POLICY_PLANNERS`)
chooses the batch. This module runs the step and applies what came back.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
from shared.messages import PLAIN_LOGITS, ForwardBatch, LogitsParams, SamplingParams, StepResult, StopParams, TokenLogprobs

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
        out = StepOutput(step=self._step, cancelled=self._cancelled)
        self._step += 1
        self._cancelled = []
        self._in_step = True
        try:
            plan = self._plan(prefill_tokens)
            slots, tokens = plan.slots_and_tokens()
            growth = self.kv.growth(slots, tokens)
            victims = self.kv.preemption_victims(slots, growth)
            if victims:
                plan = plan.without(victims)
                out.preempted = self._preempt(victims)
                slots, tokens = plan.slots_and_tokens()
                growth = self.kv.growth(slots, tokens)
            if not plan.is_empty:
                updates = self.kv.allocate(slots, growth)
                batch = build_forward_batch(out.step, plan, updates, self.table, self.page_size)
                result = executor.execute(batch)
                self._apply(plan, batch, result, out)
        finally:
            self._in_step = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            for rid in deferred:
                self.abort(rid)
        return out

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

    # ------------------------------------------------------------------ applying results
    def _apply(self, plan: StepPlan, batch: ForwardBatch, result: StepResult, out: StepOutput) -> None:
        table = self.table
        token_ids, result_step = np.asarray(result.next_token_ids), result.step
        ds = plan.decode_slots
        completing = [r for r, n in plan.prefill if r.prefilled + n == r.prompt_len]
        num_sampling = ds.shape[0] + len(completing)
        if result_step != batch.step or token_ids.shape != (num_sampling,):
            raise ExecutorError(
                f"step {batch.step}: expected {num_sampling} token ids for step {batch.step}, got "
                f"shape {token_ids.shape} for step {result_step}")

        if ds.shape[0]:
            table.kv_len[ds] += 1
        if plan.prefill:
            table.kv_len[plan.prefill_slots] += np.asarray([n for _, n in plan.prefill], dtype=np.int64)
            for request, n in plan.prefill:
                request.prefilled += n
                self.kv.cache_prompt_pages(request)
        if completing:
            chunking = self.prefill_manager.chunking
            self.prefill_manager.chunking = [r for r in chunking if r.prefilled < r.prompt_len]
            for request in completing:
                self.decode_manager.add(request)
            cslots = np.fromiter((r.slot for r in completing), dtype=np.int64, count=len(completing))
            out.cached_tokens = {r.rid: r.cached_tokens for r in completing
                                 if r.cached_tokens and r.num_generated_before == 0}
            sample_slots = np.concatenate([ds, cslots])
            sample_rids = plan.decode_rids + [r.rid for r in completing]
        else:
            sample_slots, sample_rids = ds, plan.decode_rids
        table.output_ids[sample_slots, table.generated[sample_slots]] = token_ids
        table.generated[sample_slots] += 1
        table.last_token[sample_slots] = token_ids
        reached_limit = table.generated[sample_slots] >= table.token_limit[sample_slots]
        if self.eos_token_ids.shape[0] == 1:
            stopped = (token_ids == self.eos_token_ids[0]) & table.check_eos[sample_slots]
        elif self.eos_token_ids.shape[0]:
            stopped = np.isin(token_ids, self.eos_token_ids) & table.check_eos[sample_slots]
        else:
            stopped = np.zeros(num_sampling, dtype=bool)
        for i in np.flatnonzero(table.has_stop_ids[sample_slots]).tolist():
            if int(token_ids[i]) in table.requests[int(sample_slots[i])].stop_ids:
                stopped[i] = True

        out.prefill = [(r.rid, n) for r, n in plan.prefill]
        out.decode = list(plan.decode_rids)
        out.new_tokens = list(zip(sample_rids, token_ids.tolist()))
        if result.logprobs:
            out.logprobs = {sample_rids[i]: lp for i, lp in zip(result.logprob_rows, result.logprobs)}
        for slot, entries in result.prompt_logprobs:
            table.requests[slot].prompt_logprobs.extend(entries)  # type: ignore[union-attr]  # admitted
        if completing:
            out.prompt_logprobs = {r.rid: r.prompt_logprobs for r in completing if r.wants_prompt_logprobs}
        out.batch_size = batch.num_requests
        done = np.flatnonzero(stopped | reached_limit).tolist()
        if done:
            out.finished = [sample_rids[i] for i in done]
            out.finish_reasons = {sample_rids[i]: "stop" if stopped[i] else "length" for i in done}
            self._release([self._live[rid] for rid in out.finished])

    def _release(self, requests: list[Request], *, forget: bool = True) -> None:
        """Give back the slots and every KV page of admitted requests (and forget them: they ended)."""
        for request in requests:
            if request.prefilled < request.prompt_len:
                self.prefill_manager.chunking.remove(request)
            else:
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

