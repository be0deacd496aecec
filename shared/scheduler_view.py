"""What the scheduler shows of itself to the live view (`/dashboard`): the chapter's containers and
numbers as they stand, and the steps since the last look. Built by `procs.scheduler.live_view`, sent
to the api inside `SchedulerStats.view`, served as JSON by `procs.api.live_view`."""

from __future__ import annotations

import msgspec

# The waiting queue can hold thousands under overload: the view lists its head only (and counts the rest).
WAITING_SHOWN = 64
STEPS_KEPT = 128  # step summaries one view carries at most (the latest; a view every 0.5 s)


class RequestView(msgspec.Struct, kw_only=True):
    """One request in the waiting queue or holding a slot."""

    rid: str
    status: str  # `Request.Status`'s value: waiting, preempted, prefilling or running
    slot: int  # its request-table row (-1: waiting)
    prompt_tokens: int  # the client's prompt
    prefilled: int  # prompt tokens whose KV is computed (of this admission's prompt, recompute included)
    generated: int
    max_tokens: int
    kv_pages: int  # pages it holds now (its own and shared prefix-cache pages)
    kv_reserved_pages: int  # pages reserved for it: held or still to come (SCHEDULING.md's reservation)
    cached_tokens: int  # prompt tokens its first admission found in the prefix cache
    priority: int
    adapter: int  # 0: the base model (`shared.lora`)
    waited_s: float  # since its arrival at the scheduler


class KvView(msgspec.Struct, kw_only=True):
    """The KV pool in pages: `used` are allocated (running requests' and cached ones), `reserved` the
    admitted requests' reservations (may exceed `total` when the reserve ratio is below 1), `cached` in
    the prefix cache (of which `cached_referenced` are used by running requests)."""

    page_size: int
    total: int
    used: int
    free: int
    reserved: int
    cached: int = 0
    cached_referenced: int = 0


class StepView(msgspec.Struct, array_like=True):
    """One completed step: its number, prompt tokens it prefilled, decode rows, requests, its time as the
    scheduler saw it (ms; 0: not timed) and the step-time bound's prediction and prefill cap (-1: none)."""

    step: int
    prefill_tokens: int
    decode_rows: int
    batch_size: int
    step_ms: float
    predicted_ms: float
    prefill_cap: int


class SchedulerView(msgspec.Struct, kw_only=True):
    """The scheduler now: its requests (running set in slot order, then the waiting queue's head in queue
    order), slots, KV pages, its settings, and the steps completed since the previous view."""

    requests: list[RequestView]
    num_waiting: int
    slots_total: int
    slots_used: int
    kv: KvView
    steps: list[StepView] = []
    policy: str = ""  # prefill-first | mixed | fixed
    prefill_budget: int = 0
    max_step_ms: float = 0.0  # the step-time target (0: no bound)
    build_ms: float = 0.0  # what building this view cost the scheduler
