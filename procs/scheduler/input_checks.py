"""What the scheduler is handed from outside, checked before it changes any state (`core.Scheduler`):
a new request, refused with a `Refusal` that the api returns to its client (SCHEDULING.md 1: a request
that could never fit is refused at arrival, never admitted to wait forever); a draft for a decoding
request (ValueError); and an executor's `StepResult` for a launched step (`ExecutorError`: a worker that
answers another step, or more or fewer tokens than the step samples, is broken, not the request).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchserve.procs.scheduler.config import SchedulerConfig
from batchserve.procs.scheduler.executor import ExecutorError
from batchserve.procs.scheduler.kv_manager import KVManager
from batchserve.procs.scheduler.request import check_runner, prompt_array
from batchserve.procs.scheduler.step_output import LaunchedStep
from batchserve.shared.checks import MAX_TOKEN_ID, check_priority
from batchserve.shared.config import request_cap
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import ForwardBatch, RequestParams, StepResult


def checked_prompt(
    config: SchedulerConfig,
    kv: KVManager,
    prompt_ids: Sequence[int] | np.ndarray,
    params: RequestParams,
    *,
    max_pages_per_request: int,
    num_requests: int,
) -> np.ndarray:
    """A new request's prompt as the scheduler keeps it, or a `Refusal`: a priority that this server's
    queue order ignores, a request its runner does not answer, an encoder's input longer than a step, a
    request whose prompt and `max_tokens` can never fit in the KV cache, or a full server
    (`num_requests` already in it)."""
    priority = params.priority
    if priority and config.scheduling_policy != "priority":
        raise Refusal(
            f"priority {priority} needs --scheduling-policy priority (this server schedules first come, first served)",
            "priority",
        )
    check_priority(priority)
    check_runner(params, config.pooling)
    prompt = prompt_array(prompt_ids)
    if config.whole_prompts and prompt.shape[0] > config.prefill_budget:
        raise Refusal(
            f"this model is an encoder: an input runs whole in one step, and this one's {prompt.shape[0]} "
            f"tokens exceed the prefill budget of {config.prefill_budget} (--prefill-budget)",
            "prompt",
        )
    # max_tokens is settled (>= 1, 0 for pooling; within the context) by the tokenizer: the scheduler trusts it.
    max_tokens = params.stop.max_tokens
    assert max_tokens is not None, "max_tokens is settled by the tokenizer before a request gets here"
    total = prompt.shape[0] + max_tokens
    # with a window, the worst over any recompute too (its prompt then holds the generated tokens)
    if kv.pages_for(kv.windowed(total, total)) > config.num_kv_pages or kv.pages_for(total) > max_pages_per_request:
        raise Refusal(
            f"prompt ({prompt.shape[0]} tokens) + max_tokens ({max_tokens}) = {total} can never fit "
            f"in the KV cache of {config.num_kv_pages * config.page_size} tokens",
            "max_tokens",
        )
    capacity = request_cap(config.max_running_requests, config.max_waiting)
    if capacity is not None and num_requests >= capacity:
        raise Refusal(
            f"the server is full ({config.max_running_requests} running + {config.max_waiting} waiting requests)",
            status=503,
        )
    return prompt


def checked_draft(draft: Sequence[int] | np.ndarray) -> np.ndarray:
    """A draft's tokens as an array, or ValueError unless they are token ids."""
    tokens = np.asarray(draft)
    if (
        tokens.ndim != 1
        or not np.issubdtype(tokens.dtype, np.integer)
        or (tokens.shape[0] and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID))
    ):
        raise ValueError(f"a draft is token ids in [0, 2**31), got {tokens!r}")
    return tokens


def checked_result(
    batch: ForwardBatch, launched: LaunchedStep, result: StepResult
) -> tuple[np.ndarray, np.ndarray | None]:
    """The token ids of `batch`'s step, and how many of each row's tokens verification accepted (None:
    every one), or `ExecutorError` if `result` answers another step or does not fit the rows."""
    token_ids = np.asarray(result.next_token_ids)
    if result.step != batch.step or token_ids.shape != (batch.num_sampled,):
        raise ExecutorError(
            f"step {batch.step}: expected {batch.num_sampled} token ids for step {batch.step}, got "
            f"shape {token_ids.shape} for step {result.step}"
        )
    if not result.accepted_lens:
        return token_ids, None
    accepted = np.asarray(result.accepted_lens, dtype=np.int64)
    if accepted.shape != launched.sample_lens.shape or not ((accepted >= 1) & (accepted <= launched.sample_lens)).all():
        raise ExecutorError(
            f"step {batch.step}: accepted_lens {result.accepted_lens} do not fit the "
            f"rows' sample lens {launched.sample_lens.tolist()}"
        )
    return token_ids, accepted
