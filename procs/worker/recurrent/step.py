"""`RecurrentStateStep`: a hybrid model's recurrent states in the worker's step pipeline
(`procs.worker.step_hooks`): before the forward pass a cached prefix's state goes into its new slot
(`SlotStart.restore_state`); after it, the states the prefix cache keeps are saved (`ForwardBatch.state_saves`)."""

from __future__ import annotations

from batchserve.kernels.recurrent_state import RecurrentStatePool
from batchserve.shared.messages import ForwardBatch


class RecurrentStateStep:
    def __init__(self, states: RecurrentStatePool) -> None:
        self.states = states

    def before_forward(self, batch: ForwardBatch) -> None:
        self.states.restore([(s.slot, s.restore_state) for s in batch.slot_starts if s.restore_state >= 0])

    def after_forward(self, batch: ForwardBatch) -> None:
        self.states.save(batch.state_saves)
