"""Rank 0 leads, the other tensor-parallel ranks follow: the step broadcast.

The scheduler talks to one worker endpoint, global rank 0's. Rank 0 broadcasts each step it is given,
as it will run it (its `FUTURE_TOKEN` inputs filled, the rows whose logits it needs), over the CPU
group, and every rank runs the same forward pass; only rank 0 samples and answers. Broadcasting
beats every rank subscribing to the scheduler: the ForwardBatch's arrays live in rank 0's machine's
shared memory, the inputs rank 0 fills exist only there, and one sender fixes the order of steps.

While idle, rank 0 broadcasts a tick every `TICK_INTERVAL_S`, so a follower's wait, bounded by the
group's timeout, ends within it only when rank 0 is gone or hung. Stopping, it broadcasts `RankStop`.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from batchserve.procs.worker.parallel import TensorParallel
from batchserve.shared.codec import Decoder, Encoder
from batchserve.shared.messages import ForwardBatch
from batchserve.shared.parallel import TICK_INTERVAL_S

BROADCAST_BYTES = 1 << 16  # one broadcast carries a step up to this size (a decode step of 64 rows is ~3 KB)


class RankStep(msgspec.Struct, tag="step"):
    """One step to run: the batch as rank 0 runs it, and the packed token rows whose logits it needs."""

    batch: ForwardBatch
    logits_rows: np.ndarray | None


class RankTick(msgspec.Struct, tag="tick"):
    """Nothing to run: rank 0 is alive and idle."""


class RankStop(msgspec.Struct, tag="stop"):
    """Rank 0 is stopping: followers exit."""


RankMessage = RankStep | RankTick | RankStop


class RankSteps:
    """The broadcast over `tp`'s ranks: rank 0 calls `lead`, `tick` and `stop`; the others `follow`."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self._encoder = Encoder()  # arrays inline: the bytes travel to other machines
        self._decoder: Decoder[RankMessage] = Decoder(RankMessage)
        self._last_sent = time.monotonic()

    @property
    def active(self) -> bool:
        return self.tp.world_size > 1

    def _send(self, message: RankMessage) -> None:
        self.tp.broadcast_bytes(self._encoder.encode(message), BROADCAST_BYTES)
        self._last_sent = time.monotonic()

    def lead(self, batch: ForwardBatch, logits_rows: np.ndarray | None) -> None:
        if self.active:
            self._send(RankStep(batch=batch, logits_rows=logits_rows))

    def tick(self) -> None:
        """While idle: a tick if nothing went out for `TICK_INTERVAL_S`."""
        if self.active and time.monotonic() - self._last_sent >= TICK_INTERVAL_S:
            self._send(RankTick())

    def stop(self) -> None:
        if self.active:
            self._send(RankStop())

    def follow(self) -> RankMessage:
        """The next message from rank 0 (raises when the group's timeout passes without one, or rank 0
        is gone)."""
        return self._decoder.decode(self.tp.broadcast_bytes(None, BROADCAST_BYTES))
