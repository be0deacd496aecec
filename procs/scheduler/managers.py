"""The chapter's two request pools and what each plans: `PrefillManager.pending_list` (waiting
queue, prefill chunks and admissions within a budget) and `DecodeManager.running` (the decode set, by slot);
and `POLICY_PLANNERS`, the registry of policies that choose a step's batch from the two."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from batchserve.procs.scheduler.batch import DecodeView, StepPlan
from batchserve.procs.scheduler.kv_manager import KVManager
from batchserve.procs.scheduler.prefix_cache import CachedPage
from batchserve.procs.scheduler.request import NO_DRAFT, Request, Status
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.shared.config import POLICIES


class PrefillManager:
    """Requests whose prompt is not fully prefilled.

    `pending_list`: the waiting queue (not admitted: no slot, no KV). FIFO, except that preempted
    requests go back ahead of every request never admitted, in the order of their first admission;
    with `by_priority`, ordered by priority, then arrival (SCHEDULING.md section 8).
    `chunking`: admitted requests with prompt tokens left (mid-chunk), in admission order; their
    next chunks are planned before any new admission, so they keep priority (with `fair`, at most
    half of a step's tokens while others wait).
    """

    def __init__(
        self,
        table: RequestTable,
        kv: KVManager,
        *,
        by_priority: bool = False,
        fair: bool = False,
        max_loras: int = 0,
        whole: bool = False,
    ) -> None:
        self.pending_list: deque[Request] = deque()
        self.chunking: list[Request] = []
        self.by_priority = by_priority
        self.fair = fair  # fair prefill (SCHEDULING.md section 9): a long prompt leaves room for those behind it
        self.max_loras = max_loras  # distinct LoRA adapters among the admitted requests (0: no limit)
        self.whole = whole  # an encoder's: a prompt is admitted only with room for all of it in the step (no chunks)
        self._table = table
        self._kv = kv
        self._admissions = 0  # admission sequence numbers (re-admissions get new ones)
        self.first_admissions: list[Request] = []  # admitted for the first time, since the caller last took them

    def enqueue(self, request: Request) -> None:
        """A new arrival: at the tail, or with `by_priority` behind every request of its priority or a
        higher one (a lower value)."""
        if self.by_priority:
            self._insert_by_key(request)
        else:
            self.pending_list.append(request)

    def _insert_by_key(self, request: Request) -> None:
        pending, key = self.pending_list, request.queue_key
        index = len(pending)
        while index > 0 and pending[index - 1].queue_key > key:  # usually none: arrivals of one priority
            index -= 1
        pending.insert(index, request)

    @property
    def nobody_admitted(self) -> bool:
        """No request holds a slot (none is prefilling or decoding)."""
        return self._table.num_used == 0

    def plan(self, budget: int, *, admit: bool) -> list[tuple[Request, int]]:
        """SCHEDULING.md step 3: mid-chunk requests first, then FIFO admissions while they fit; with
        `fair`, an item others could follow takes at most half of `budget`, and what admissions leave
        goes back to the items so held (SCHEDULING.md section 9).

        Each item is (request, prompt tokens this step); admitted requests get their slot here.
        """
        share = budget - budget // 2 if self.fair and not self.whole else budget
        items: list[tuple[Request, int]] = []
        held: list[int] = []  # items the share kept below their prompt's rest

        def take(request: Request, others: bool) -> None:
            nonlocal budget
            rest = self._kv.chunk_limit(request)
            n = min(rest, budget, share if others else budget)
            if n < min(rest, budget):
                held.append(len(items))
            items.append((request, n))
            budget -= n

        chunking, pending = self.chunking, self.pending_list
        admit = admit and bool(pending)
        for index, request in enumerate(chunking):
            if budget <= 0:
                return items
            take(request, index + 1 < len(chunking) or admit)
        reserved = -1  # sum of reservations, computed once the head is considered
        while admit and pending and budget > 0 and self._table.has_free_slot:
            head = pending[0]
            if not self._adapter_fits(head):
                break  # its adapter waits for one of the running adapters to finish, and so does everyone behind it
            if self.whole and head.prompt_len > budget:
                # an encoder's input runs whole: it waits for a step with room for it, and so does everyone behind it
                break
            cached = self._kv.lookup(head)
            pages = self._kv.reservation(head, cached)
            if reserved < 0:
                reserved = self._kv.reserved_pages()
            if pages + reserved > self._kv.num_pages:
                break  # no skipping ahead: the head waits, and so does everyone behind it
            pending.popleft()
            self._admit(head, cached)
            reserved += pages
            take(head, bool(pending))
        for index in held:  # nobody took the rest: the held items have it, in order
            if budget <= 0:
                break
            request, n = items[index]
            extra = min(self._kv.chunk_limit(request) - n, budget)
            items[index] = (request, n + extra)
            budget -= extra
        return items

    def _adapter_fits(self, request: Request) -> bool:
        """`max_loras`: its adapter runs already, or fewer than that many distinct ones do (base rows aside)."""
        adapter = request.params.adapter
        if not adapter or not self.max_loras:
            return True
        running = {r.params.adapter for r in self._table.requests if r is not None and r.params.adapter}
        return adapter in running or len(running) < self.max_loras

    def _admit(self, request: Request, cached: list[CachedPage]) -> None:
        seq = self._admissions
        self._admissions += 1
        request.move_to(Status.PREFILLING)
        request.slot = self._table.acquire(request, seq)
        request.starting = True
        self._kv.attach(request, cached)  # starts past its cached prefix
        if request.first_admitted < 0:
            request.first_admitted = seq
            request.cached_tokens = request.prefilled
            self.first_admissions.append(request)
        self.chunking.append(request)

    def victims_for_head(self) -> list[int]:
        """SCHEDULING.md section 8: the slots of the admitted requests the head of the waiting queue
        preempts to be admitted, in preemption order (lowest priority first, among equals the most
        recently admitted): the fewest after which it fits with their reservations given back, each of
        a lower priority than the head's; none when it fits already or they could not make it fit."""
        if not self.pending_list:
            return []
        head, table, kv = self.pending_list[0], self._table, self._kv
        short = kv.reservation(head, kv.lookup(head)) + kv.reserved_pages() - kv.num_pages
        if short <= 0 and table.has_free_slot:
            return []
        lower = sorted(
            (r for r in table.requests if r is not None and r.params.priority > head.params.priority),
            key=lambda r: (r.params.priority, int(table.admit_seq[r.slot])),
            reverse=True,
        )
        victims: list[int] = []
        for request in lower:
            victims.append(request.slot)
            short -= kv.own_reservation(request.slot)
            if short <= 0:
                return victims
        return []

    def requeue(self, request: Request) -> None:
        """Put a preempted request back: ahead of every never-admitted request, behind the preempted
        ones that were first admitted before it; with `by_priority`, by priority then arrival, the same
        order among requests of one priority (admission follows the queue)."""
        if self.by_priority:
            self._insert_by_key(request)
            return
        pending = self.pending_list
        index = 0
        while index < len(pending) and 0 <= pending[index].first_admitted < request.first_admitted:
            index += 1
        pending.insert(index, request)


class DecodeManager:
    """`running`: the admitted requests with the whole prompt prefilled, by slot, in admission order
    (an index into the scheduler's one request table; a request leaves it once the step that reaches
    its token limit is launched).

    The decode batch view (slots as a numpy array, ids, sampling params, row widths) is cached and
    rebuilt only when membership changes, so a steady decode step does no per-request Python work to
    plan. `drafting`: the running requests with a draft (their rows are wider than one token), by slot.
    """

    def __init__(self) -> None:
        self.running: dict[int, Request] = {}
        self.drafting: dict[int, Request] = {}
        self._view: DecodeView | None = None
        self._rows: dict[int, int] = {}  # slot -> its row in the view, built when a draft needs it

    def __len__(self) -> int:
        return len(self.running)

    def __contains__(self, slot: int) -> bool:
        return slot in self.running

    @property
    def has_wide_rows(self) -> bool:
        """Whether a running request's next row is wider than one token (it has a draft)."""
        return bool(self.drafting)

    def add(self, request: Request) -> None:
        self.running[request.slot] = request
        self._view = None

    def remove(self, slot: int) -> None:
        del self.running[slot]
        self.drafting.pop(slot, None)
        self._view = None

    def set_draft(self, request: Request, draft: np.ndarray) -> None:
        request.draft = draft
        self.drafting[request.slot] = request

    def clear_drafts(self) -> None:
        """Every draft is gone: into a launched step's rows, or dropped (they would cost a preemption)."""
        for request in self.drafting.values():
            request.draft = NO_DRAFT
        self.drafting.clear()

    def batch_view(self) -> DecodeView:
        """Every running request's row, in admission order.

        The lists are replaced, never mutated, on membership change: callers may keep them.
        """
        if self._view is None:
            reqs = self.running.values()
            n = len(self.running)
            self._view = DecodeView(
                np.fromiter(self.running, dtype=np.int64, count=n),
                [r.rid for r in reqs],
                [r.params.sampling for r in reqs],
                np.ones(n, dtype=np.int64),
                n,
            )
            self._rows = {}
        if not self.drafting:
            return self._view
        if not self._rows:
            self._rows = {slot: i for i, slot in enumerate(self.running)}
        widths = self._view.widths.copy()
        for slot, request in self.drafting.items():
            widths[self._rows[slot]] += request.draft.shape[0]
        return self._view._replace(widths=widths, tokens=int(widths.sum()))


# A policy plans one step: (prefill, decode, prefill_budget, this step's prompt-token cap) -> StepPlan.
PolicyPlanner = Callable[[PrefillManager, DecodeManager, int, int], StepPlan]


def plan_mixed(prefill: PrefillManager, decode: DecodeManager, budget: int, cap: int) -> StepPlan:
    """Every decode, plus prefill chunks and admissions in what the decodes leave of the budget (a
    decode row counts its width, one token per sampled position)."""
    view = decode.batch_view()
    return StepPlan.of(prefill.plan(min(budget - view.tokens, cap), admit=True), view)


def plan_prefill_first(prefill: PrefillManager, decode: DecodeManager, budget: int, cap: int) -> StepPlan:
    """Prefill chunks and admissions whenever there are any; the decodes run in steps without."""
    return _prefill_else_decode(prefill, decode, min(budget, cap), admit=True)


def plan_fixed(prefill: PrefillManager, decode: DecodeManager, budget: int, cap: int) -> StepPlan:
    """As prefill-first, but a group forms only when nobody is admitted, then runs to its end."""
    return _prefill_else_decode(prefill, decode, min(budget, cap), admit=prefill.nobody_admitted)


def _prefill_else_decode(prefill: PrefillManager, decode: DecodeManager, budget: int, *, admit: bool) -> StepPlan:
    items = prefill.plan(budget, admit=admit)
    return StepPlan.of(items) if items else StepPlan.of([], decode.batch_view())


# The registry: policy name -> planner; its names are the config's (`shared.config.Policy`).
POLICY_PLANNERS: dict[str, PolicyPlanner] = {
    "prefill-first": plan_prefill_first,
    "mixed": plan_mixed,
    "fixed": plan_fixed,
}
assert set(POLICY_PLANNERS) == set(POLICIES), f"policies {sorted(POLICY_PLANNERS)} != the config's {sorted(POLICIES)}"
