"""The continuous-batching scheduler of the chapter, as exact rules in /work/shared/SCHEDULING.md.

One `step()` is the chapter's iteration (section 4.2): new requests and aborts have already been
taken in by `add_request` / `abort`; the policy chooses a batch (prefill chunks and/or decodes); the
executor runs it; the results are applied (tokens appended, stop conditions checked, and finished
requests give back their slot and every KV page in the same step).

KV accounting is in pages. For a request r with T(r) = prompt + max_tokens - (sampled - fed back)
token positions it may ever hold, reservation(r) = ceil(T(r) / page_size) pages = allocated + need.
A waiting request X fits when a slot is free and
    ceil(T(X) / page_size) + sum of reservation(r) over admitted r <= usable pages,
which is SCHEDULING.md's `need(X) + sum need(r) <= capacity - sum allocated(r)`; with page size 1
it is that rule token for token. Reservations only shrink, so the allocator can never run dry.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from procs.scheduler.config import SchedulerConfig
from procs.scheduler.executor import Executor, ExecutorError
from procs.scheduler.kv_allocator import PageAllocator
from procs.scheduler.managers import DecodeManager, PrefillManager
from procs.scheduler.request import Request
from procs.scheduler.request_table import RequestTable
from shared.messages import ForwardBatch, SamplingParams, StopParams

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
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


class _Plan(NamedTuple):
    prefill: list[tuple[Request, int]]
    prefill_slots: np.ndarray
    decode_slots: np.ndarray
    decode_rids: list[str]
    decode_sampling: list[SamplingParams]


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
        self.allocator = PageAllocator(self.num_kv_pages)
        self.table = RequestTable(config.max_running_requests, self.max_pages_per_request)
        self.prefill_manager = PrefillManager()
        self.decode_manager = DecodeManager()
        self._live: dict[str, Request] = {}  # waiting + admitted, by rid
        self._reserved_pages = 0  # sum of reservation(r) over admitted r
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
        return self.allocator.num_used * self.page_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_pages * self.page_size

    @property
    def kv_reserved_tokens(self) -> int:
        return self._reserved_pages * self.page_size

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

    @property
    def step_index(self) -> int:
        """Index the next `step()` will carry."""
        return self._step

    def has_unfinished(self) -> bool:
        """True while requests wait or run, or aborts are still to be reported by a `step()`."""
        return bool(self._live) or bool(self._cancelled)

    def rid_in_slot(self, slot: int) -> str | None:
        request = self.table.requests[slot]
        return None if request is None else request.rid

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, rid: str, prompt_ids: Sequence[int] | np.ndarray, sampling: SamplingParams,
                    stop: StopParams) -> None:
        """Queue a request at the tail of the waiting queue, or raise `RequestRejectedError`."""
        if rid in self._live:
            raise RequestRejectedError(rid, "a request with this id is already queued or running")
        prompt = self._validate_prompt(rid, prompt_ids)
        max_tokens = stop.max_tokens
        if max_tokens < 1:
            raise RequestRejectedError(rid, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        total = prompt.shape[0] + max_tokens
        max_context = self.config.max_context
        if max_context and total > max_context:
            raise RequestRejectedError(
                rid, f"prompt ({prompt.shape[0]} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"context limit of {max_context} tokens", param="max_tokens")
        if self._pages_for(total) > self.num_kv_pages:
            raise RequestRejectedError(
                rid, f"prompt ({prompt.shape[0]} tokens) + max_tokens ({max_tokens}) = {total} can never fit "
                f"in the KV cache of {self.kv_capacity_tokens} tokens", param="max_tokens")
        if self.config.max_waiting and self.num_waiting >= self.config.max_waiting:
            raise RequestRejectedError(
                rid, f"the waiting queue is full ({self.config.max_waiting} requests)", status=503)
        request = Request(rid, prompt, sampling, stop)
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
    def step(self, executor: Executor) -> StepOutput:
        """Choose a batch by the policy, execute it, apply the results. Idle steps still count."""
        out = StepOutput(step=self._step, cancelled=self._cancelled)
        self._step += 1
        self._cancelled = []
        self._in_step = True
        try:
            plan = self._plan()
            if plan.prefill or plan.decode_slots.shape[0]:
                batch = self._build_batch(out.step, plan)
                result = executor.execute(batch)
                self._apply(plan, batch, np.asarray(result.next_token_ids), result.step, out)
        finally:
            self._in_step = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            for rid in deferred:
                self.abort(rid)
        return out

    # ------------------------------------------------------------------ planning
    def _plan(self) -> _Plan:
        policy = self.config.policy
        budget = self.config.prefill_budget
        if policy == "mixed":
            slots, rids, sampling = self.decode_manager.batch_view()
            prefill = self._plan_prefill(budget - len(rids), admit=True)
            return _Plan(prefill, _slots_of(prefill), slots, rids, sampling)
        # prefill-first, and fixed: a group forms only when nobody is admitted, then runs to the end.
        admit = policy == "prefill-first" or self.table.num_used == 0
        prefill = self._plan_prefill(budget, admit=admit)
        if prefill:
            return _Plan(prefill, _slots_of(prefill), _EMPTY_I64, [], [])
        slots, rids, sampling = self.decode_manager.batch_view()
        return _Plan(prefill, _EMPTY_I64, slots, rids, sampling)

    def _plan_prefill(self, budget: int, *, admit: bool) -> list[tuple[Request, int]]:
        """SCHEDULING.md step 3: mid-chunk requests first, then FIFO admissions while they fit."""
        items: list[tuple[Request, int]] = []
        for request in self.prefill_manager.chunking:
            if budget <= 0:
                return items
            n = min(request.prompt_len - request.prefilled, budget)
            items.append((request, n))
            budget -= n
        if not admit:
            return items
        pending = self.prefill_manager.pending_list
        table = self.table
        while pending and budget > 0 and table.has_free_slot:
            head = pending[0]
            pages = self._pages_for(head.prompt_len + head.max_tokens)
            if pages + self._reserved_pages > self.num_kv_pages:
                break  # no skipping ahead: the head waits, and so does everyone behind it
            pending.popleft()
            head.slot = table.acquire(head, pages)
            self._reserved_pages += pages
            self.prefill_manager.chunking.append(head)
            n = min(head.prompt_len, budget)
            items.append((head, n))
            budget -= n
        return items

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ------------------------------------------------------------------ the ForwardBatch
    def _build_batch(self, step: int, plan: _Plan) -> ForwardBatch:
        """Packs decodes first, then prefill chunks; assigns the KV pages this step writes into."""
        table = self.table
        P = self.page_size
        ds = plan.decode_slots
        ids_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        loc_parts: list[np.ndarray] = []
        upd_slots: list[np.ndarray] = []
        upd_cols: list[np.ndarray] = []
        upd_pages: list[np.ndarray] = []
        slots: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        samples: list[bool] = []
        sampling: list[SamplingParams] = []
        sample_counts: list[int] = []

        nd = ds.shape[0]
        if nd:
            pos = table.kv_len[ds]
            grow = table.num_pages[ds] * P <= pos  # the fed-back token starts a new page
            if grow.any():
                gslots = ds[grow]
                gcols = table.num_pages[gslots]
                pages = self.allocator.alloc(gslots.shape[0])
                table.ensure_columns(int(gcols.max()) + 1)
                table.page_table[gslots, gcols] = pages
                table.num_pages[gslots] += 1
                upd_slots.append(gslots)
                upd_cols.append(gcols)
                upd_pages.append(pages)
            ids_parts.append(table.last_token[ds])
            pos_parts.append(pos)
            loc_parts.append(table.page_table[ds, pos // P].astype(np.int64) * P + pos % P)
            slots = ds.tolist()
            prefix_lens = pos.tolist()
            extend_lens = [1] * nd
            samples = [True] * nd
            sampling = list(plan.decode_sampling)
            sample_counts = table.generated[ds].tolist()

        if plan.prefill:
            # All chunks at once: a fixed number of numpy calls however many requests prefill.
            reqs = [r for r, _ in plan.prefill]
            lens = [n for _, n in plan.prefill]
            starts = [r.prefilled for r in reqs]
            pslots = plan.prefill_slots
            n_arr = np.asarray(lens, dtype=np.int64)
            p0 = np.asarray(starts, dtype=np.int64)
            have = table.num_pages[pslots]
            want = -(-(p0 + n_arr) // P)
            need = want - have  # >= 0: pages already held cover the tokens prefilled so far
            total = int(need.sum())
            if total:
                pages = self.allocator.alloc(total)
                table.ensure_columns(int(want.max()))
                gslots = np.repeat(pslots, need)
                gcols = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(need) - need - have, need)
                table.page_table[gslots, gcols] = pages
                table.num_pages[pslots] = want
                upd_slots.append(gslots)
                upd_cols.append(gcols)
                upd_pages.append(pages)
            pos = np.arange(int(n_arr.sum()), dtype=np.int64) - np.repeat(np.cumsum(n_arr) - n_arr - p0, n_arr)
            ids_parts.append(np.concatenate([r.prompt[a:a + n] for r, a, n in zip(reqs, starts, lens)]))
            pos_parts.append(pos)
            loc_parts.append(table.page_table[np.repeat(pslots, n_arr), pos // P].astype(np.int64) * P + pos % P)
            slots += pslots.tolist()
            prefix_lens += starts
            extend_lens += lens
            samples += [a + n == r.prompt_len for r, a, n in zip(reqs, starts, lens)]
            sampling += [r.sampling for r in reqs]
            sample_counts += [0] * len(reqs)

        return ForwardBatch(
            step=step, slots=slots, prefix_lens=prefix_lens, extend_lens=extend_lens, samples=samples,
            sampling=sampling, sample_counts=sample_counts,
            input_ids=_concat_i32(ids_parts), positions=_concat_i32(pos_parts), kv_locs=_concat_i32(loc_parts),
            page_table_slots=_concat_i32(upd_slots), page_table_cols=_concat_i32(upd_cols),
            page_table_pages=_concat_i32(upd_pages),
        )

    # ------------------------------------------------------------------ applying results
    def _apply(self, plan: _Plan, batch: ForwardBatch, token_ids: np.ndarray, result_step: int,
               out: StepOutput) -> None:
        table = self.table
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
        if completing:
            chunking = self.prefill_manager.chunking
            self.prefill_manager.chunking = [r for r in chunking if r.prefilled < r.prompt_len]
            for request in completing:
                self.decode_manager.add(request)
            # A first sampled token is not fed back before the next decode: T(r) shrinks by one.
            cslots = np.fromiter((r.slot for r in completing), dtype=np.int64, count=len(completing))
            shrunk = -(-np.fromiter((r.prompt_len + r.max_tokens - 1 for r in completing), dtype=np.int64,
                                    count=len(completing)) // self.page_size)
            self._reserved_pages -= int((table.reserved_pages[cslots] - shrunk).sum())
            table.reserved_pages[cslots] = shrunk

        if completing:
            sample_slots = np.concatenate([ds, cslots])
            sample_rids = plan.decode_rids + [r.rid for r in completing]
        else:
            sample_slots, sample_rids = ds, plan.decode_rids
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
        out.batch_size = batch.num_requests
        done = np.flatnonzero(stopped | reached_limit).tolist()
        if done:
            out.finished = [sample_rids[i] for i in done]
            out.finish_reasons = {sample_rids[i]: "stop" if stopped[i] else "length" for i in done}
            self._release([self._live[rid] for rid in out.finished])

    def _release(self, requests: list[Request]) -> None:
        """Give back the slots and every KV page of admitted requests, and forget them."""
        for request in requests:
            if request.prefilled < request.prompt_len:
                self.prefill_manager.chunking.remove(request)
            else:
                self.decode_manager.remove(request.rid)
            del self._live[request.rid]
        slots = np.fromiter((r.slot for r in requests), dtype=np.int64, count=len(requests))
        self._reserved_pages -= int(self.table.reserved_pages[slots].sum())
        self.allocator.free(self.table.release(slots))
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


def _slots_of(items: list[tuple[Request, int]]) -> np.ndarray:
    return np.fromiter((r.slot for r, _ in items), dtype=np.int64, count=len(items))


def _concat_i32(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY_I32
    if len(parts) == 1:
        return parts[0].astype(np.int32, copy=False)
    return np.concatenate(parts).astype(np.int32, copy=False)
