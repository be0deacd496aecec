"""Reading a completed step's tokens: which count (`kept_tokens`: not those of rows whose request ended
while the step ran, nor a row's tokens past what verification accepted or past the one that ends its
request), which are stop tokens, settling each row to what it kept (`settle_rows`), and the
logprobs that came with them (`record_logprobs`), or the pooling runner's vectors in their place
(`record_pooled`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from batchserve.procs.scheduler.executor import ExecutorError
from batchserve.procs.scheduler.kv_manager import KVManager
from batchserve.procs.scheduler.request import Request
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.procs.scheduler.speculation.ngram import pause_after
from batchserve.procs.scheduler.step_output import KeptTokens, LaunchedStep, StepOutput
from batchserve.shared.messages import StepResult


def settle_rows(
    table: RequestTable, kv: KVManager, launched: LaunchedStep, kept: KeptTokens, out: StepOutput, min_acceptance: float
) -> None:
    """Each live row keeps the tokens that count (those verification accepted, up to the one that ends
    its request) and rolls back the rest (KV positions, generated count, the pages past its KV), so
    that a release caches exactly the tokens it has; a row that carried a draft counts it and updates
    its request's back-off. A row one token wide keeps its token: nothing to do, so a step of such rows
    returns at once."""
    slots, lens = launched.sample_slots, launched.sample_lens
    if not lens.shape[0] or int(lens.max()) == 1:
        return
    if kept.positions is None:
        counted = lens
    else:
        rows = np.repeat(np.arange(lens.shape[0]), lens)
        counted = np.bincount(rows[kept.positions], minlength=lens.shape[0])
    live = table.admit_seq[slots] == launched.admit_seq
    for i in np.flatnonzero(live & (lens > 1)).tolist():
        request = table.requests[int(slots[i])]
        assert request is not None
        proposed, accepted = int(lens[i] - 1), int(counted[i] - 1)
        out.drafted.append((request.rid, proposed, accepted))
        request.draft_tokens += proposed
        request.accepted_tokens += accepted
        paid = accepted > min_acceptance * proposed
        request.spec_misses = 0 if paid else request.spec_misses + 1
        request.spec_pause = pause_after(request.spec_misses)
    short = np.flatnonzero(live & (counted < lens))
    if short.shape[0]:
        rejected, rslots = lens[short] - counted[short], slots[short]
        table.kv_len[rslots] -= rejected
        table.generated[rslots] -= rejected
        kv.truncate(rslots)


def kept_tokens(
    table: RequestTable,
    eos_token_ids: np.ndarray,
    launched: LaunchedStep,
    token_ids: np.ndarray,
    accepted: np.ndarray | None = None,
) -> KeptTokens:
    """The sampled tokens that count, each with its slot and index in its request's output: not those
    of rows whose request ended while the step ran, nor a row's tokens past what verification
    `accepted`, nor those after the one that ends it."""
    slots, rids, index = launched.sample_slots, launched.sample_rids, launched.token_index
    num_sampled = token_ids.shape[0]
    if num_sampled == slots.shape[0]:  # a token per row
        row, offset = None, None
        live = table.admit_seq[slots] == launched.admit_seq  # still the admission that launched the row
    else:
        lens = launched.sample_lens
        row = np.repeat(np.arange(slots.shape[0]), lens)
        row_starts = np.cumsum(lens) - lens
        offset = np.arange(num_sampled, dtype=np.int64) - row_starts[row]
        slots, index = slots[row], index[row] + offset
        live = table.admit_seq[slots] == launched.admit_seq[row]
        if accepted is not None:
            live &= offset < accepted[row]
    stopped = stop_tokens(table, eos_token_ids, slots, token_ids, live)
    ends = (stopped | (index + 1 >= table.token_limit[slots])) & live
    keep = live
    if row is not None and ends.any():
        first_end = np.minimum.reduceat(np.where(ends, offset, num_sampled), row_starts)
        keep = live & (offset <= first_end[row])
    positions = None
    if not keep.all():
        positions = np.flatnonzero(keep)
        slots, index, token_ids, stopped, ends = (a[positions] for a in (slots, index, token_ids, stopped, ends))
    if row is not None:
        rids = [rids[i] for i in (row if positions is None else row[positions]).tolist()]
    elif positions is not None:
        rids = [rids[i] for i in positions.tolist()]
    return KeptTokens(slots, index, token_ids, rids, stopped, ends, positions)


def stop_tokens(
    table: RequestTable, eos_token_ids: np.ndarray, slots: np.ndarray, token_ids: np.ndarray, live: np.ndarray
) -> np.ndarray:
    """Which tokens are a stop token of their request (EOS unless ignore_eos, or a stop_token_id)."""
    if eos_token_ids.shape[0] == 1:
        stopped = (token_ids == eos_token_ids[0]) & table.check_eos[slots]
    elif eos_token_ids.shape[0]:
        stopped = np.isin(token_ids, eos_token_ids) & table.check_eos[slots]
    else:
        stopped = np.zeros(slots.shape[0], dtype=bool)
    for i in np.flatnonzero(table.has_stop_ids[slots] & live).tolist():
        # union-attr: a live row's slot holds its request (no None check on this per-token path)
        if int(token_ids[i]) in table.requests[int(slots[i])].params.stop.stop_token_ids:  # type: ignore[union-attr]
            stopped[i] = True
    return stopped


def record_logprobs(live: Mapping[str, Request], launched: LaunchedStep, result: StepResult, kept: KeptTokens) -> None:
    """Into `launched.out`: the kept tokens' logprobs, and the prompt logprobs of the prompts this step
    completed (of the requests still `live`, by rid, in the admission that launched them)."""
    out, rids = launched.out, kept.rids
    if result.logprobs:
        where = None if kept.positions is None else dict(zip(kept.positions.tolist(), range(len(rids))))
        for at, lp in zip(result.logprob_rows, result.logprobs):
            i = at if where is None else where.get(at)
            if i is not None:
                out.logprobs.setdefault(rids[i], []).append(lp)
    # By the slot each chunk ran in (a request aborted or preempted since has given it back).
    prefilling: dict[int, Request] = dict(
        zip(launched.plan.prefill_slots.tolist(), (r for r, _ in launched.plan.prefill))
    )
    for slot, entries in result.prompt_logprobs:
        request = prefilling.get(slot)
        if request is not None and live.get(request.rid) is request and request.slot == slot:
            request.prompt_logprobs.extend(entries)
    out.prompt_logprobs = {
        r.rid: r.prompt_logprobs for r in launched.completing if r.wants_prompt_logprobs and live.get(r.rid) is r
    }


def record_pooled(launched: LaunchedStep, result: StepResult, kept: KeptTokens) -> None:
    """Into `launched.out`: the pooling runner's answer, each kept row's vector in place of its token
    (float32 bytes, `TokenDelta.pooled`); each such row is its request's stop."""
    if result.pooled is None:
        return
    pooled = np.asarray(result.pooled, dtype="<f4")
    if pooled.ndim != 2 or pooled.shape[0] != result.next_token_ids.shape[0]:
        raise ExecutorError(
            f"step {result.step}: {pooled.shape} pooled vectors for {result.next_token_ids.shape[0]} sampled rows"
        )
    at = range(len(kept.rids)) if kept.positions is None else kept.positions.tolist()
    launched.out.pooled = {rid: pooled[i].tobytes() for rid, i in zip(kept.rids, at)}
    kept.stopped[:] = True  # a vector is the whole answer: its request stops (finish reason "stop")
