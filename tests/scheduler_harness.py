"""Test harness for the scheduler: fake models that audit every ForwardBatch (`AuditingExecutor`: rules
and positions; `KVContentExecutor`: what every KV position holds), and a driver that replays a
workload while checking procs/scheduler/SCHEDULING.md's rules with an independent bookkeeping of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchserve.procs.scheduler import Scheduler, SchedulerConfig, StepOutput
from batchserve.shared.messages import FUTURE_TOKEN, ForwardBatch, RequestParams, StepResult, StopParams

EOS = 2
FIRST_TOKEN = 100  # the k-th sampled token (0-based) of every request is FIRST_TOKEN + k, unless EOS


@dataclass
class Job:
    """A request of a workload: it emits EOS as its `output_tokens`-th token."""

    rid: str
    arrival_step: int
    input_tokens: int
    output_tokens: int
    max_tokens: int | None = None
    ignore_eos: bool = False
    stop_after: int | None = None  # its (stop_after)-th token, FIRST_TOKEN + stop_after - 1, is a stop token id
    cancel_before_step: int | None = None

    @property
    def limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.output_tokens

    def prompt(self) -> list[int]:
        return list(range(3, 3 + self.input_tokens))

    def scripted(self, k: int) -> int:
        """Its k-th sampled token (0-based)."""
        return EOS if k + 1 == self.output_tokens else FIRST_TOKEN + k

    def stop_params(self) -> StopParams:
        stop_ids = () if self.stop_after is None else (FIRST_TOKEN + self.stop_after - 1,)
        return StopParams(max_tokens=self.limit, ignore_eos=self.ignore_eos, stop_token_ids=stop_ids)

    def expected_end(self) -> tuple[int, str]:
        """(tokens generated, finish reason) if never cancelled."""
        ends = [(self.limit, "length")]
        if not self.ignore_eos:
            ends.append((self.output_tokens, "stop"))
        if self.stop_after is not None and self.stop_after != self.output_tokens:  # that one is EOS instead
            ends.append((self.stop_after, "stop"))
        n = min(e[0] for e in ends)
        return n, "stop" if any(e == (n, "stop") for e in ends) else "length"


class AuditingExecutor:
    """Plays the worker: keeps its own page table from the batch's updates and checks that every
    token is fed at the right position, into a page its request owns, that prefill feeds the prompt
    (followed, when recomputing after a preemption, by exactly the tokens sampled before) and that
    decodes feed back exactly the token sampled last."""

    def __init__(self, scheduler: Scheduler, jobs: dict[str, Job]) -> None:
        self.scheduler = scheduler
        self.jobs = jobs
        self.P = scheduler.page_size
        self.page_table: dict[tuple[int, int], int] = {}
        self.page_owner: dict[int, str] = {}
        self.slot_rid: dict[int, str] = {}
        self.written: dict[str, int] = {}  # KV positions written per request since its (re-)admission
        self.fill: dict[str, list[int]] = {}  # what its (re-)admission prefills: prompt + tokens sampled before
        self.sampled: dict[str, list[int]] = {}
        self.calls = 0

    def forget(self, rid: str) -> None:
        """The request ended or was preempted: its slot row and pages may be reused by others from now on."""
        for slot, owner in list(self.slot_rid.items()):
            if owner == rid:
                del self.slot_rid[slot]
                for key in [k for k in self.page_table if k[0] == slot]:
                    del self.page_table[key]
        for page in [p for p, owner in self.page_owner.items() if owner == rid]:
            del self.page_owner[page]
        self.written.pop(rid, None)

    def execute(self, batch: ForwardBatch) -> StepResult:
        self.calls += 1
        n = batch.num_requests
        assert n > 0, "an empty batch was executed"
        for name in ("prefix_lens", "extend_lens", "sample_lens", "sampling", "sample_counts"):
            assert len(getattr(batch, name)) == n, name
        assert len(set(batch.slots)) == n, "a slot appears twice in one batch"
        for name in ("input_ids", "positions", "kv_locs", "page_table_slots", "page_table_cols", "page_table_pages"):
            assert getattr(batch, name).dtype == np.int32, name
        assert batch.num_tokens == sum(batch.extend_lens)
        assert batch.positions.shape == batch.kv_locs.shape == batch.input_ids.shape

        for slot, rid in list(self.slot_rid.items()):
            if self.scheduler.rid_in_slot(slot) != rid:  # preempted in this step (a worker is never told)
                self.forget(rid)
        for slot in batch.slots:
            rid = self.scheduler.rid_in_slot(slot)
            assert rid is not None, f"slot {slot} holds no request"
            if self.slot_rid.get(slot) != rid:
                assert slot not in self.slot_rid, f"slot {slot} reused while {self.slot_rid[slot]} still holds it"
                assert rid not in self.written, f"{rid} moved to slot {slot} without being preempted"
                self.slot_rid[slot] = rid
                self.written[rid] = 0
                self.fill[rid] = self.jobs[rid].prompt() + self.sampled.get(rid, [])
        for slot, col, page in zip(
            batch.page_table_slots.tolist(), batch.page_table_cols.tolist(), batch.page_table_pages.tolist()
        ):
            rid = self.slot_rid[slot]
            assert 1 <= page < self.scheduler.num_pool_pages, (
                f"page {page} outside 1..{self.scheduler.num_pool_pages - 1}"
            )
            assert page not in self.page_owner, f"page {page} given to {rid} while {self.page_owner[page]} holds it"
            assert (slot, col) not in self.page_table, f"page-table entry ({slot}, {col}) overwritten"
            assert col < self.scheduler.max_pages_per_request
            self.page_owner[page] = rid
            self.page_table[(slot, col)] = page

        out: list[int] = []
        offset = 0
        for i, slot in enumerate(batch.slots):
            rid = self.slot_rid[slot]
            job = self.jobs[rid]
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            assert p == self.written[rid], f"{rid}: prefix {p} but {self.written[rid]} positions written"
            sl = slice(offset, offset + e)
            offset += e
            positions = batch.positions[sl]
            assert positions.tolist() == list(range(p, p + e))
            expected_locs = [self.page_table[(slot, q // self.P)] * self.P + q % self.P for q in range(p, p + e)]
            assert batch.kv_locs[sl].tolist() == expected_locs, f"{rid}: kv_locs off its pages"
            sampled = self.sampled.setdefault(rid, [])
            fill = self.fill[rid]
            if p >= len(fill):  # prompt done: a decode feeding back the last sampled token
                assert e == batch.sample_lens[i] == 1 and batch.input_ids[sl].tolist() == [sampled[-1]], (
                    f"{rid}: bad decode input"
                )
            else:
                assert p + e <= len(fill)
                assert batch.input_ids[sl].tolist() == fill[p : p + e], f"{rid}: prefill fed the wrong tokens"
                assert batch.sample_lens[i] == int(p + e == len(fill))
            self.written[rid] = p + e
            assert batch.sample_counts[i] == len(sampled)
            if batch.sample_lens[i]:
                token = job.scripted(len(sampled))
                sampled.append(token)
                out.append(token)
        assert offset == batch.num_tokens
        return StepResult(step=batch.step, next_token_ids=np.asarray(out, dtype=np.int32))


class KVContentExecutor:
    """Writes (token, position) into a simulated pool and checks every request's context each step.

    `owners`: the request of each batch row (default: the request in its slot now; a batch run after
    the scheduler moved on passes the owners from when it was launched). `FUTURE_TOKEN` inputs are
    fed the slot's last sampled token, as the worker does."""

    def __init__(self, sched: Scheduler, prompts: dict[str, list[int]], outputs: dict[str, int]) -> None:
        self.sched, self.prompts, self.outputs = sched, prompts, outputs
        self.P = sched.page_size
        self.page_table: dict[tuple[int, int], int] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # flat KV location -> (token id, position)
        self.sampled: dict[str, list[int]] = {}
        self.last_sampled: dict[int, int] = {}  # slot -> its last sampled token
        self.reused_tokens = 0  # context positions read from pages another request wrote
        # A hybrid model's linear-attention states: the tokens each slot's state and each snapshot has taken in
        self.slot_state: dict[int, list[int]] = {}
        self.snapshots: dict[int, list[int]] = {}

    def token(self, rid: str, k: int) -> int:
        return EOS if k + 1 == self.outputs[rid] else FIRST_TOKEN + k

    def execute(self, batch: ForwardBatch, owners: list[str] | None = None) -> StepResult:
        for slot, col, page in zip(
            batch.page_table_slots.tolist(), batch.page_table_cols.tolist(), batch.page_table_pages.tolist()
        ):
            self.page_table[(slot, col)] = page
        for start in batch.slot_starts:  # a state restored from a snapshot, or zeros
            self.slot_state[start.slot] = list(self.snapshots[start.restore_state]) if start.restore_state >= 0 else []
        out, offset = [], 0
        writers: dict[int, str] = {}
        for i, slot in enumerate(batch.slots):
            rid = self.sched.rid_in_slot(slot) if owners is None else owners[i]
            sampled = self.sampled.setdefault(rid, [])
            seq = self.prompts[rid] + sampled
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            part = slice(offset, offset + e)
            offset += e
            assert batch.positions[part].tolist() == list(range(p, p + e))
            fed = [self.last_sampled[slot] if t == FUTURE_TOKEN else t for t in batch.input_ids[part].tolist()]
            assert fed == seq[p : p + e], f"{rid}: fed the wrong tokens"
            assert batch.sample_counts[i] == len(sampled)
            for q, loc in zip(range(p, p + e), batch.kv_locs[part].tolist()):
                assert loc == self.page_table[(slot, q // self.P)] * self.P + q % self.P
                assert writers.setdefault(loc, rid) == rid, "two requests write one KV position in one step"
                self.kv[loc] = (seq[q], q)
            for q in range(p):  # the context this step attends to, through the page table
                loc = self.page_table[(slot, q // self.P)] * self.P + q % self.P
                assert self.kv.get(loc) == (seq[q], q), f"{rid}: KV at position {q} is not its own token"
            if self.sched.config.recurrent_state:
                state = self.slot_state.setdefault(slot, [])
                if p == 0:
                    state.clear()  # the worker starts a row at position 0 from zeros
                assert state == seq[:p], f"{rid}: its slot's state is not its context's"
                state.extend(fed)
            for _ in range(batch.sample_lens[i]):
                token = self.token(rid, len(sampled))
                sampled.append(token)
                self.last_sampled[slot] = token
                out.append(token)
        for slot, snapshot in batch.state_saves:
            self.snapshots[snapshot] = list(self.slot_state[slot])
        return StepResult(step=batch.step, next_token_ids=np.asarray(out, dtype=np.int32))


def audit_references(sched: Scheduler) -> None:
    """Every node's reference count is the number of admitted requests whose path holds it; paths run
    from the root; no page is both cached and free, or cached and some request's own page."""
    cache = sched.kv.cache
    admitted = [sched.table.requests[s] for s in range(sched.table.num_slots) if sched.table.requests[s]]
    counts: dict[int, int] = {}
    for request in admitted:
        parent = cache.root(sched.kv.cache_namespace(request))
        for node in request.cache_path:
            assert node.parent is parent, "a request's cache path is not a path from the root"
            counts[id(node)] = counts.get(id(node), 0) + 1
            parent = node
    stack = [node for root in cache.roots.values() for node in root.children.values()]
    referenced, tree_pages = 0, []
    while stack:
        node = stack.pop()
        assert node.refs == counts.get(id(node), 0), f"page {node.page}: refs {node.refs}"
        referenced += node.refs > 0
        tree_pages.append(node.page)
        stack.extend(node.children.values())
    assert referenced == cache.num_referenced and len(tree_pages) == cache.num_pages
    free = set(sched.allocator._free[: sched.allocator.num_free].tolist())
    own: list[int] = []
    for request in admitted:
        slot = request.slot
        row = sched.table.page_table[slot, : sched.table.num_pages[slot]].tolist()
        shared = {n.page for n in request.cache_path}
        own += [p for p in row if p not in shared]
        assert sum(p in shared for p in row) == sched.table.shared_pages[slot]
    assert not (set(tree_pages) & free) and not (set(tree_pages) & set(own)) and not (set(own) & free)
    assert len(own) == len(set(own)), "a page is two requests' own"
    assert len(tree_pages) + len(own) + len(free) == sched.num_kv_pages


@dataclass
class _Book:
    """The driver's own view of one request, kept from StepOutputs only."""

    job: Job
    admitted: bool = False
    admit_seq: int = -1  # of its latest admission
    first_admit_seq: int = -1
    prefilled: int = 0  # of `fill_len`, since its latest admission
    generated: int = 0
    fed: int = 0  # since its latest admission
    fill_len: int = 0  # what its latest admission prefills: the prompt + tokens generated before
    filled_seq: int = -1  # when its latest prefill completed (the decode set's order with fair prefill)
    ended: str = ""  # "", "finished", "cancelled"
    preemptions: int = 0
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fill_len = self.job.input_tokens


def draw_jobs(draw, *, arrivals: int, prompts: int, outputs: int, limits: int, cancel_within: int) -> list[Job]:
    """1-10 random jobs (a hypothesis `draw`): arrival steps 0..arrivals, prompts of 1..prompts tokens,
    EOS as token 1..outputs, maybe max_tokens 1..limits, ignore_eos and a stop token id; one in four
    is cancelled within `cancel_within` steps of its arrival."""
    from hypothesis import strategies as st

    jobs = []
    for i in range(draw(st.integers(1, 10))):
        job = Job(
            rid=f"r{i}",
            arrival_step=draw(st.integers(0, arrivals)),
            input_tokens=draw(st.integers(1, prompts)),
            output_tokens=draw(st.integers(1, outputs)),
            max_tokens=draw(st.none() | st.integers(1, limits)),
            ignore_eos=draw(st.booleans()),
            stop_after=draw(st.none() | st.integers(1, outputs)),
        )
        if draw(st.integers(0, 3)) == 0:  # a cancel or a client gone, at any step
            job.cancel_before_step = job.arrival_step + draw(st.integers(0, cancel_within))
        jobs.append(job)
    return jobs


def pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def estimate(percent: int, remaining: int) -> int:
    """ceil(rho * remaining), as procs/scheduler/SCHEDULING.md computes it."""
    return (percent * remaining + 99) // 100


def reservation(b: _Book, percent: int, page_size: int) -> int:
    """Pages of allocated(r) + est(r): KV held, prompt still to prefill, estimated future tokens."""
    allocated = b.prefilled + b.fed
    return pages(allocated + (b.fill_len - b.prefilled) + estimate(percent, b.job.limit - b.generated), page_size)


def run_and_check(config: SchedulerConfig, jobs: list[Job], max_steps: int = 5000) -> list[StepOutput]:
    """Replay `jobs` step by step; assert every scheduling rule and invariant along the way."""
    sched = Scheduler(config, eos_token_ids=(EOS,))
    by_rid = {j.rid: j for j in jobs}
    ex = AuditingExecutor(sched, by_rid)
    books = {j.rid: _Book(j) for j in jobs}
    waiting: list[str] = []  # the driver's own queue
    P = config.page_size
    percent = config.kv_reserve_percent
    usable_pages = config.kv_capacity_tokens // P
    last_arrival = max(j.arrival_step for j in jobs)
    trace: list[StepOutput] = []
    admissions = 0
    fills = 0

    for step in range(max_steps):
        for j in jobs:
            if j.arrival_step == step:
                sched.add_request(j.rid, j.prompt(), RequestParams(stop=j.stop_params()))
                waiting.append(j.rid)
        cancelled_now: list[str] = []
        for j in jobs:
            if j.cancel_before_step == step:
                b = books[j.rid]
                assert sched.abort(j.rid) == (b.ended == "" and j.arrival_step <= step)
                if j.arrival_step <= step and not b.ended:
                    b.ended = "cancelled"
                    cancelled_now.append(j.rid)
                    if j.rid in waiting:
                        waiting.remove(j.rid)
                    ex.forget(j.rid)
        if step > last_arrival and all(b.ended for b in books.values()) and not cancelled_now:
            break
        assert sched.has_unfinished() == (
            bool(cancelled_now) or any(not b.ended and b.job.arrival_step <= step for b in books.values())
        )

        # What procs/scheduler/SCHEDULING.md says about the head of the queue, from the driver's own books.
        live_admitted = sorted((b for b in books.values() if b.admitted and not b.ended), key=lambda b: b.admit_seq)
        free_slots = config.max_running_requests - len(live_admitted)
        reserved = sum(reservation(b, percent, P) for b in live_admitted)
        head = books[waiting[0]] if waiting else None
        head_fits = head is not None and reservation(head, percent, P) + reserved <= usable_pages
        # The decode set is in admission order (SCHEDULING.md 2); with fair prefill, in prefill-completion order.
        decodable = (
            [b.job.rid for b in sorted(live_admitted, key=lambda b: b.filled_seq) if b.prefilled == b.fill_len]
            if config.fair_prefill
            else [b.job.rid for b in live_admitted if b.prefilled == b.fill_len]
        )
        chunking = [b.job.rid for b in live_admitted if b.prefilled < b.fill_len]

        out = sched.step(ex)
        trace.append(out)
        assert out.step == step

        # Step 3b: victims are the most recently admitted, and none of this step's admissions.
        assert out.preempted == [b.job.rid for b in reversed(live_admitted)][: len(out.preempted)], (
            f"step {step}: preempted {out.preempted}, not the most recently admitted first"
        )
        if percent == 100:
            assert not out.preempted, "the worst-case reservation never preempts"
        prefill_rids = [rid for rid, _ in out.prefill]
        admitted_now = [rid for rid in prefill_rids if not books[rid].admitted]
        assert not (admitted_now and out.preempted), "a step that admits never preempts"
        old_chunks = sum(n for rid, n in out.prefill if books[rid].admitted)
        planned_prefill = bool(out.prefill) or bool(set(chunking) & set(out.preempted))
        if config.policy == "mixed":
            assert out.decode == [d for d in decodable if d not in out.preempted], "mixed decodes every running request"
            assert sum(n for _, n in out.prefill) + len(out.decode) <= config.prefill_budget
        else:
            assert sum(n for _, n in out.prefill) <= config.prefill_budget
            if planned_prefill:
                assert not out.decode, f"{config.policy}: a step is either prefill or decode"
            elif not out.preempted:
                assert out.decode == decodable, f"{config.policy}: decode every request done with prefill"
            else:
                assert out.decode in ([], [d for d in decodable if d not in out.preempted])
        allowance = config.prefill_budget - (len(out.decode) if config.policy == "mixed" else 0)
        short = [rid for rid, n in out.prefill if n < books[rid].fill_len - books[rid].prefilled]
        if short and not out.preempted:  # a chunk stops short of its prompt only when the step is full
            assert sum(n for _, n in out.prefill) == allowance, f"step {step}: {short} short, allowance left"
        if head is not None and config.policy != "fixed" and not out.preempted:
            budget_left = config.prefill_budget - old_chunks - (len(out.decode) if config.policy == "mixed" else 0)
            should = free_slots > 0 and budget_left > 0 and head_fits
            assert (head.job.rid in prefill_rids) == should, (
                f"step {step}: head {head.job.rid} admitted={head.job.rid in prefill_rids}, expected {should} "
                f"(free slots {free_slots}, budget left {budget_left}, fits {head_fits})"
            )
        if config.policy == "fixed":
            if admitted_now:
                assert not live_admitted, "fixed: nobody joins a running group"
            if head is not None and not live_admitted:
                assert head.job.rid in prefill_rids, "fixed: a new group forms as soon as the last one ends"

        # Apply the step to the books: preemptions first (they happened before the batch ran).
        for rid in out.preempted:
            b = books[rid]
            b.admitted = False
            b.prefilled = b.fed = 0
            b.fill_len = b.job.input_tokens + b.generated
            b.preemptions += 1
            ex.forget(rid)
            before = [
                w for w in waiting if books[w].first_admit_seq >= 0 and books[w].first_admit_seq < b.first_admit_seq
            ]
            waiting.insert(len(before), rid)
        for rid, n in out.prefill:
            b = books[rid]
            if not b.admitted:
                assert waiting and waiting[0] == rid, f"{rid} admitted out of queue order"
                waiting.pop(0)
                b.admitted = True
                b.admit_seq = admissions
                if b.first_admit_seq < 0:
                    b.first_admit_seq = admissions
                admissions += 1
            assert 1 <= n and b.prefilled + n <= b.fill_len
            b.prefilled += n
            if b.prefilled == b.fill_len:
                b.filled_seq = fills
                fills += 1
        for rid in out.decode:
            books[rid].fed += 1
        for rid, token in out.new_tokens:
            b = books[rid]
            assert token == b.job.scripted(b.generated), f"{rid}: token {b.generated} is not its scripted one"
            b.generated += 1
            b.tokens.append(token)
        assert out.batch_size == len(out.prefill) + len(out.decode)
        assert set(out.finish_reasons) == set(out.finished)
        for rid in out.finished:
            b = books[rid]
            n, reason = b.job.expected_end()
            assert (b.generated, out.finish_reasons[rid]) == (n, reason), rid
            assert b.tokens == [b.job.scripted(k) for k in range(n)], f"{rid}: tokens lost or repeated"
            assert b.prefilled == b.fill_len, "chunks must add up to the prompt"
            b.ended = "finished"
            ex.forget(rid)
        assert sorted(out.cancelled) == sorted(cancelled_now)

        # Invariants after every step.
        live = [b for b in books.values() if b.admitted and not b.ended]
        assert sched.num_running == len(live)
        assert sched.num_waiting == len(waiting)
        assert sched.kv_used_tokens <= sched.kv_capacity_tokens
        assert sched.kv_used_tokens == P * sum(pages(b.prefilled + b.fed, P) for b in live)
        assert sched.kv.reserved_pages() * sched.page_size == P * sum(reservation(b, percent, P) for b in live)
        if percent == 100:
            assert sched.kv.reserved_pages() * sched.page_size <= sched.kv_capacity_tokens
    else:
        raise AssertionError(f"not done after {max_steps} steps")

    # Everything ended and nothing leaked.
    assert all(b.ended for b in books.values())
    assert not sched.has_unfinished()
    assert sched.num_running == sched.num_waiting == 0
    assert sched.kv_used_tokens == 0 and sched.kv.reserved_pages() * sched.page_size == 0
    assert sched.allocator.num_free == usable_pages
    assert sched.table.has_free_slot and sched.table.num_used == 0
    assert all(sched.rid_in_slot(s) is None for s in range(config.max_running_requests))
    return trace
