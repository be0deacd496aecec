"""`token_deltas`: what one step did, as one `TokenDelta` per request for the detokenizer.

A delta reads the request's one record (`Request`), never changing it: the live ones from the
scheduler's request table, the ones the step finished or cancelled from `StepOutput.ended` (the
scheduler has forgotten them, their final delta has not been sent yet). A request's first delta
carries its stop params and prompt tail. Its token count is the step's (`StepOutput.token_counts`), or,
for an end without new tokens, the ended request's own (`Request.reported`).
"""

from __future__ import annotations

from collections.abc import Mapping

from batchserve.procs.scheduler.request import Request
from batchserve.procs.scheduler.step_output import StepOutput
from batchserve.shared.messages import TokenDelta


def token_deltas(out: StepOutput, live: Mapping[str, Request]) -> list[TokenDelta]:
    """The deltas of `out`: new tokens (batch order), then ends without new tokens, then cancellations.
    A cancelled rid the scheduler never knew still gets a closing delta."""
    tokens: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    assert len(out.token_counts) == len(out.new_tokens), "a count for every new token"
    for (rid, token), count in zip(out.new_tokens, out.token_counts):
        tokens.setdefault(rid, []).append(int(token))
        counts[rid] = count  # the last one's
    deltas = []
    for rid, ids in tokens.items():
        request = out.ended.get(rid) or live.get(rid)
        if rid in out.pooled:  # the pooling runner: its vector is its answer, its one "token" a placeholder
            deltas.append(_delta(request, 0, rid, [], out.finish_reasons.get(rid)))
            deltas[-1].pooled = out.pooled[rid]
            continue
        delta = _delta(request, counts[rid], rid, ids, out.finish_reasons.get(rid))
        delta.logprobs = out.logprobs.get(rid, [])
        if rid in out.prompt_logprobs and request is not None:
            delta.prompt_ids = request.client_prompt.tolist()
            delta.prompt_logprobs = out.prompt_logprobs[rid]
        deltas.append(delta)
    for rid in out.finished:
        if rid not in tokens:
            request = out.ended.get(rid)
            deltas.append(
                _delta(request, request.reported if request else 0, rid, [], out.finish_reasons.get(rid, "stop"))
            )
    for rid in out.cancelled:
        request = out.ended.get(rid)
        deltas.append(_delta(request, request.reported if request else 0, rid, [], "abort"))
        if rid in out.errors:
            deltas[-1].error, deltas[-1].error_param = out.errors[rid]
    return deltas


def _delta(request: Request | None, reported: int, rid: str, ids: list[int], finish_reason: str | None) -> TokenDelta:
    """`reported`: the request's tokens so far, these `ids` included."""
    if request is None:
        return TokenDelta(rid=rid, token_ids=ids, finish_reason=finish_reason)
    first = reported == len(ids)  # nothing reported before these (only a last delta has none)
    # Its cached prefix is reported from its first token on (the step that prefilled past it).
    cached = request.cached_tokens if reported else 0
    return TokenDelta(
        rid=rid,
        token_ids=ids,
        finish_reason=finish_reason,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=reported,
        cached_tokens=cached,
        draft_tokens=request.draft_tokens,
        accepted_tokens=request.accepted_tokens,
        stop=request.params.stop if first else None,
        prompt_tail=request.prompt_tail if first else [],
    )
