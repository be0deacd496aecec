"""The worker's startup probe: a few steps timed before serving, for the scheduler's step-cost model
(`procs.scheduler.step_cost`), each as its shape (`shared.step_features.step_shape`) and seconds.

Run only while no request holds KV: every token is written to and read from the dummy page 0 (the page
table is all zeros then), so nothing is disturbed and only the time is real.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchserve.shared.messages import ForwardBatch, SamplingParams
from batchserve.shared.step_features import StepShape, step_shape

if TYPE_CHECKING:
    from batchserve.procs.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
CHUNK_BESIDE_DECODES = 100  # a probe step's chunk beside 16 decodes (a hybrid's linear layers pad it to 128)
# A slow model's probe (an 8B model on 2 cores: 4 s for 32 tokens) would take minutes of the start: a step
# slower than REPEAT_MAX_S runs once (its noise is small beside it), and the prefill chunks after the first
# shrink to what a step of STEP_MAX_S holds, predicted from the first (never below MIN_SPREAD_TOKENS: the
# fit needs a spread of tokens; the live steps refit it).
REPEAT_MAX_S = 0.5
STEP_MAX_S = 3.0
MIN_SPREAD_TOKENS = 64
MIN_BESIDE_TOKENS = 16  # the chunk beside decodes of a slow model: its tokens' spread is the solo chunks' job
WARM_UP = ([0], [8])  # the first step, not timed: lazy set-up, a few tokens (an 8B model's 32 took 6 s)
# A warm-up slower than this marks a slow model, whose first chunk shrinks (`first_chunk`) and whose second
# keeps SPREAD times its tokens (at most MIN_SPREAD_TOKENS): an 8B model on 2 cores probed 32 and 64 tokens in
# 20 s, half of its 43 s start.
SLOW_WARM_UP_S = 1.0
SPREAD = 3


def probe_step_costs(
    runner: ModelRunner, prefill_tokens: tuple[int, ...] = (32, 256), decode_batches: tuple[int, ...] | None = None
) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of a few steps, the best of two runs each, after a short warm-up step. Small ones: the
    fit only needs a spread of tokens and rows, and the scheduler refits on live steps (a large step would
    add seconds to a CPU start; a slow model's are cut shorter still: `affordable_tokens`). Prefill chunks
    alone, decode batches of 1 and 16 (and 4 for a mixture of experts, whose cost bends as more of its
    experts are read), and 16 decodes beside a chunk."""
    if decode_batches is None:
        decode_batches = (1, 4, 16) if getattr(runner.config, "moe", None) else (1, 16)
    context = min(256, runner.max_context - 1)
    shapes = [([0], [n]) for n in prefill_tokens if n < runner.max_context]
    shapes += [([context] * b, [1] * b) for b in decode_batches if b <= runner.max_running_requests]
    if runner.max_running_requests > 16 and context + CHUNK_BESIDE_DECODES < runner.max_context:
        shapes.append(([context] * 16 + [0], [1] * 16 + [CHUNK_BESIDE_DECODES]))
    warm_s = timed_step(runner, probe_batch(runner, *WARM_UP))
    shapes[0] = ([0], [first_chunk(shapes[0][1][0], warm_s)])
    costs: list[tuple[StepShape, float]] = []
    first_tokens = shapes[0][1][0]
    for prefix_lens, extend_lens in shapes:
        if costs and extend_lens[-1] > first_tokens:  # a longer chunk: no longer than a slow model allows
            spread = min(MIN_SPREAD_TOKENS, SPREAD * first_tokens)
            floor = spread if len(extend_lens) == 1 else MIN_BESIDE_TOKENS
            cut = affordable_tokens(extend_lens[-1], first_tokens, costs[0][1], floor)
            extend_lens = [*extend_lens[:-1], cut]
        seconds = repeated_step(runner, probe_batch(runner, prefix_lens, extend_lens))
        costs.append((step_shape(prefix_lens, extend_lens, runner.cost_windows), seconds))
    return costs


def first_chunk(tokens: int, warm_s: float) -> int:
    """The first chunk's tokens: `tokens`, or for a slow model (its warm-up past SLOW_WARM_UP_S, the chunk past
    STEP_MAX_S at its pace) what half of STEP_MAX_S holds, never below the warm-up's tokens."""
    warm_tokens = WARM_UP[1][0]
    if warm_s <= SLOW_WARM_UP_S or tokens * warm_s / warm_tokens <= STEP_MAX_S:
        return tokens
    return min(tokens, max(warm_tokens, int(warm_tokens * STEP_MAX_S / 2 / warm_s)))


def affordable_tokens(tokens: int, first_tokens: int, first_s: float, floor: int = MIN_SPREAD_TOKENS) -> int:
    """`tokens`, or fewer where a chunk of `first_tokens` took `first_s` and `tokens` would pass STEP_MAX_S
    (never below `floor`)."""
    fits = int(first_tokens * STEP_MAX_S / max(first_s, 1e-9))
    return min(tokens, max(floor, fits))


def repeated_step(runner: ModelRunner, batch: ForwardBatch) -> float:
    """The faster of two runs (less disturbed), or the one run of a step slower than REPEAT_MAX_S."""
    seconds = timed_step(runner, batch)
    return seconds if seconds > REPEAT_MAX_S else min(seconds, timed_step(runner, batch))


def probe_batch(runner: ModelRunner, prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
    """A step of rows feeding `extend_lens` tokens after `prefix_lens`, every token on the dummy page."""
    n = len(extend_lens)
    positions = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]).astype(np.int32)
    empty = np.zeros(0, dtype=np.int32)
    # tokens spread over the vocabulary: a mixture of experts routes them apart, as real prompts are
    ids = ((np.arange(positions.shape[0], dtype=np.int64) * 7919 + 11) % runner.vocab_size).astype(np.int32)
    return ForwardBatch(
        step=-1,
        slots=list(range(n)),
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        sample_lens=[1] * n,
        sampling=[GREEDY] * n,
        sample_counts=[0] * n,
        input_ids=ids,
        positions=positions,
        kv_locs=positions % runner.page_size,
        page_table_slots=empty,
        page_table_cols=empty,
        page_table_pages=empty,
    )


def timed_step(runner: ModelRunner, batch: ForwardBatch) -> float:
    """Seconds the runner takes for `batch`, the device synchronised."""
    started = time.perf_counter()
    runner.execute(batch)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - started
