"""What runs a planned batch: the `Executor` protocol, and a scripted fake for simulation and tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from batchserve.shared.messages import ForwardBatch, StepResult
from batchserve.shared.verification import accepted_lengths


class Executor(Protocol):
    """Runs one `ForwardBatch`; returns one token id per sampled position (`sample_lens`), in batch order."""

    def execute(self, batch: ForwardBatch) -> StepResult: ...


class ExecutorError(RuntimeError):
    """An executor answered a batch with the wrong number of tokens (or for another step)."""


def scripted_token(k: int, output_tokens: int, *, eos_token_id: int = 2, first_token_id: int = 100) -> int:
    """The k-th (0-based) token `ScriptedExecutor` samples for a request that emits EOS as its
    `output_tokens`-th."""
    return eos_token_id if k + 1 >= output_tokens else first_token_id + k


class ScriptedExecutor:
    """A fake model: the request in slot s emits EOS as its `output_tokens(s)`-th token.

    Other tokens are `first_token_id + k` for the k-th sampled token (0-based; a row's j-th position
    is its `sample_counts[i] + j`-th), so they never equal the EOS id as long as `first_token_id > eos_token_id`.
    Rows with a draft are verified as the worker does (`shared.verification`). With `pooling`, as the
    pooling runner's worker, every sampled row also returns a vector.
    """

    def __init__(
        self,
        output_tokens: Callable[[int], int],
        *,
        eos_token_id: int = 2,
        first_token_id: int = 100,
        pooling: bool = False,
    ) -> None:
        if first_token_id <= eos_token_id:
            raise ValueError("first_token_id must be above eos_token_id so scripted tokens never look like EOS")
        self._output_tokens = output_tokens
        self._eos = eos_token_id
        self._first = first_token_id
        self._pooling = pooling  # the pooling runner's: each sampled row also gives a vector (one zero)

    def execute(self, batch: ForwardBatch) -> StepResult:
        ids = np.asarray(
            [
                scripted_token(k, self._output_tokens(slot), eos_token_id=self._eos, first_token_id=self._first)
                for slot, n, count in zip(batch.slots, batch.sample_lens, batch.sample_counts)
                for k in range(count, count + n)
            ],
            dtype=np.int32,
        )
        result = StepResult(step=batch.step, next_token_ids=ids)
        if self._pooling:
            result.pooled = np.zeros((ids.shape[0], 1), dtype=np.float32)
        lens = np.asarray([n for n in batch.sample_lens if n], dtype=np.int64)
        if lens.shape[0] and int(lens.max()) > 1:
            ends = np.cumsum(np.asarray(batch.extend_lens, dtype=np.int64))
            fed = np.concatenate([batch.input_ids[e - n : e] for e, n in zip(ends.tolist(), batch.sample_lens) if n])
            result.accepted_lens = accepted_lengths(ids, fed, np.cumsum(lens) - lens, lens).tolist()
        return result
