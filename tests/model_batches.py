"""A tiny batch planner for model tests: builds real `ForwardBatch`es (paged KV, page-table
updates, chunked prefill, staggered arrivals) and drives a `ModelRunner` to greedy completions."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchserve.shared.messages import ForwardBatch, SamplingParams, SlotStart

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _Request:
    prompt: list[int]
    arrival_step: int
    slot: int = -1
    fed: int = 0  # tokens whose KV is cached
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    adapter: int = 0  # its LoRA adapter in the worker (0: the base model)


def generate_greedy(
    runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    chunk: int | None = None,
    arrival_gap: int = 0,
    max_batch_tokens: int | None = None,
    adapters: list[int] | None = None,
) -> list[list[int]]:
    """Greedy-generate `max_new_tokens` per prompt through `runner.execute`.

    chunk: prefill at most this many tokens of a request per step (None: whole prompt at once).
    arrival_gap: request i joins at step i * arrival_gap, so its prefill runs beside others' decodes.
    Pages and slots are handed out from free lists in reverse order and recycled, so stale
    page-table rows and non-contiguous pages are exercised too.
    """
    page_size = runner.page_size
    free_pages = list(range(runner.kv_cache.num_pages - 1, 0, -1))
    free_slots = list(range(runner.max_running_requests - 1, -1, -1))
    requests = [
        _Request(p, i * arrival_gap, adapter=(adapters or [0] * len(prompts))[i]) for i, p in enumerate(prompts)
    ]
    step = 0
    while any(len(r.output) < max_new_tokens for r in requests):
        rows = step_rows(requests, step, [max_new_tokens] * len(requests), free_slots, chunk)
        if not rows:
            step += 1
            continue
        batch = _plan(step, rows, page_size, free_pages)
        result = runner.execute(batch)
        sampled = iter(result.next_token_ids.tolist())
        for r, tokens, samples in rows:
            r.fed += len(tokens)
            if samples:
                r.output.append(next(sampled))
                if len(r.output) >= max_new_tokens:  # finished: recycle slot and pages
                    free_slots.append(r.slot)
                    free_pages.extend(r.pages)
                    r.pages = []
        step += 1
    return [r.output for r in requests]


def step_rows(
    requests: list[_Request], step: int, new_tokens: list[int], free_slots: list[int], chunk: int | None = None
) -> list[tuple[_Request, list[int], bool]]:
    """(request, tokens it feeds, whether it samples) for each request that has arrived and still
    wants tokens (`new_tokens[i]` for request i): its next prefill chunk, or its last output token."""
    rows: list[tuple[_Request, list[int], bool]] = []
    for r, wanted in zip(requests, new_tokens):
        if r.arrival_step > step or len(r.output) >= wanted:
            continue
        if r.slot < 0:
            r.slot = free_slots.pop()
        if r.fed < len(r.prompt):
            n = len(r.prompt) - r.fed if chunk is None else min(chunk, len(r.prompt) - r.fed)
            rows.append((r, r.prompt[r.fed : r.fed + n], r.fed + n == len(r.prompt)))
        else:
            rows.append((r, [r.output[-1]], True))
    return rows


def _plan(step: int, rows, page_size: int, free_pages: list[int]) -> ForwardBatch:
    input_ids, positions, kv_locs = [], [], []
    pt_slots, pt_cols, pt_pages = [], [], []
    for r, tokens, _ in rows:
        for i, token in enumerate(tokens):
            pos = r.fed + i
            col = pos // page_size
            if col == len(r.pages):
                r.pages.append(free_pages.pop())
                pt_slots.append(r.slot)
                pt_cols.append(col)
                pt_pages.append(r.pages[-1])
            input_ids.append(token)
            positions.append(pos)
            kv_locs.append(r.pages[col] * page_size + pos % page_size)

    def i32(xs: list[int]) -> np.ndarray:
        return np.asarray(xs, dtype=np.int32)

    starts = [SlotStart(slot=r.slot, prompt_len=len(r.prompt), adapter=r.adapter) for r, _, _ in rows if r.fed == 0]
    return ForwardBatch(
        step=step,
        slot_starts=starts,
        slots=[r.slot for r, _, _ in rows],
        prefix_lens=[r.fed for r, _, _ in rows],
        extend_lens=[len(t) for _, t, _ in rows],
        sample_lens=[int(s) for _, _, s in rows],  # a row's third field: whether it samples, or how many positions
        sampling=[GREEDY] * len(rows),
        sample_counts=[len(r.output) for r, _, _ in rows],
        input_ids=i32(input_ids),
        positions=i32(positions),
        kv_locs=i32(kv_locs),
        page_table_slots=i32(pt_slots),
        page_table_cols=i32(pt_cols),
        page_table_pages=i32(pt_pages),
    )
