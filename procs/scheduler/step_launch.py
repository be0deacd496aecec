"""What launching a step decides, recorded before its tokens are known (the first half of a step,
`Scheduler.launch`; `step_results` reads the second half's tokens): each row's KV positions, the prompt
tokens prefilled (and the prompt pages that become cacheable), the tokens each sampling row will add,
the requests whose last prompt chunk makes them decode, and the decode set without those the step takes
to their token limit, so that no step launched meanwhile plans them.
"""

from __future__ import annotations

import numpy as np

from batchserve.procs.scheduler.batch import StepPlan
from batchserve.procs.scheduler.kv_manager import KVManager
from batchserve.procs.scheduler.managers import DecodeManager, PrefillManager
from batchserve.procs.scheduler.request import Request, Status
from batchserve.procs.scheduler.request_table import RequestTable
from batchserve.procs.scheduler.step_output import LaunchedStep, StepOutput
from batchserve.shared.messages import FUTURE_TOKEN, ForwardBatch


def advance_prefill(plan: StepPlan, batch: ForwardBatch, table: RequestTable, kv: KVManager) -> list[Request]:
    """The plan's prefill chunks counted as computed (KV positions, prompt progress; a prompt page they fill
    cached, with the state the worker saves for it); the requests whose prompt this step completes."""
    completing: list[Request] = []
    if not plan.prefill:
        return completing
    table.kv_len[plan.prefill_slots] += np.asarray([n for _, n in plan.prefill], dtype=np.int64)
    for request, n in plan.prefill:
        request.prefilled += n
        save = kv.cache_prompt_pages(request)  # the worker computes them before any later step reads them
        if save is not None:
            batch.state_saves.append(save)
        if request.prefilled == request.prompt_len:
            completing.append(request)
    return completing


def advance_launched(
    plan: StepPlan,
    batch: ForwardBatch,
    out: StepOutput,
    table: RequestTable,
    kv: KVManager,
    prefill_manager: PrefillManager,
    decode_manager: DecodeManager,
) -> LaunchedStep:
    """Advance what the launched `batch` of `plan` decides, before its tokens are known (see the module's
    docstring); the step as `Scheduler.complete` will read it."""
    ds, widths = plan.decode_slots, plan.decode_widths
    if ds.shape[0]:
        table.kv_len[ds] += widths
        if decode_manager.drafting:
            decode_manager.clear_drafts()  # packed into this batch's rows
    completing = advance_prefill(plan, batch, table, kv)
    if completing:
        cslots = np.fromiter((r.slot for r in completing), dtype=np.int64, count=len(completing))
        sample_slots = np.concatenate([ds, cslots])
        sample_rids = plan.decode_rids + [r.rid for r in completing]
        sample_lens = np.concatenate([widths, np.ones(len(completing), dtype=np.int64)])
    else:
        sample_slots, sample_rids, sample_lens = ds, plan.decode_rids, widths
    token_index = table.generated[sample_slots].copy()
    table.generated[sample_slots] += sample_lens
    table.last_token[sample_slots] = FUTURE_TOKEN
    # A request whose token limit this step reaches leaves the decode set now (it is released when
    # the token comes back), so no step launched meanwhile plans it.
    at_limit = table.generated[sample_slots] >= table.token_limit[sample_slots]
    nd = ds.shape[0]
    for i in np.flatnonzero(at_limit[:nd]).tolist():
        decode_manager.remove(int(ds[i]))
    if completing:
        prefill_manager.chunking = [r for r in prefill_manager.chunking if r.prefilled < r.prompt_len]
        for request, limited in zip(completing, at_limit[nd:].tolist()):
            request.move_to(Status.RUNNING)
            if not limited:
                decode_manager.add(request)
    out.prefill = [(r.rid, n) for r, n in plan.prefill]
    out.decode = list(plan.decode_rids)
    out.batch_size = batch.num_requests
    admit_seq = table.admit_seq[sample_slots].copy()
    return LaunchedStep(plan, batch, out, sample_slots, sample_rids, token_index, sample_lens, admit_seq, completing)
