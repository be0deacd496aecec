"""What runs a planned batch: the `Executor` protocol, and a scripted fake for simulation and tests."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from shared.messages import ForwardBatch, StepResult


class Executor(Protocol):
    """Runs one `ForwardBatch`; returns one token id per sampled position (`sample_lens`), in batch order."""

    def execute(self, batch: ForwardBatch) -> StepResult: ...


class ExecutorError(RuntimeError):
    """An executor answered a batch with the wrong number of tokens (or for another step)."""


class ScriptedExecutor:
    """A fake model: the request in slot s emits EOS as its `output_tokens(s)`-th token.

    Other tokens are `first_token_id + k` for the k-th sampled token (0-based; a row's j-th position
    is its `sample_counts[i] + j`-th), so they never equal the EOS id as long as `first_token_id > eos_token_id`.
    """

    def __init__(self, output_tokens: Callable[[int], int], *, eos_token_id: int = 2,
                 first_token_id: int = 100) -> None:
        if first_token_id <= eos_token_id:
            raise ValueError("first_token_id must be above eos_token_id so scripted tokens never look like EOS")
        self._output_tokens = output_tokens
        self._eos = eos_token_id
        self._first = first_token_id

    def execute(self, batch: ForwardBatch) -> StepResult:
        ids = [
            self._eos if k + 1 >= self._output_tokens(slot) else self._first + k
            for slot, n, count in zip(batch.slots, batch.sample_lens, batch.sample_counts)
            for k in range(count, count + n)
        ]
        return StepResult(step=batch.step, next_token_ids=np.asarray(ids, dtype=np.int32))
