"""The recurrent-state pool of a hybrid model's linear-attention layers (Gated DeltaNet), beside the paged
KV pool of its full-attention layers.

A linear-attention layer keeps no KV per token: each request carries a fixed-size state, the last
K - 1 inputs of its short convolution and a [key_dim, value_dim] matrix per value head. The pool holds
one state per request slot for every linear layer (`conv` [layers, slots + 1, C, K - 1] in the model's
dtype, `matrix` [layers, slots + 1, H, Dk, Dv] fp32); the extra slot is a dummy that padded decode rows
read and write. A slot's state is its request's for the request's life: a step's row that starts at
position 0 (a new request, or a recompute after preemption) starts from zeros, every later row from
what its slot holds, so chunked prefill carries the state across chunks. It follows that a row may not
start after a prefix its slot's state does not end at: speculative rows (whose rejected tokens would stay
in the state) are refused, and the prefix cache serves a prefix only from a snapshot of the state at its
end (`snapshots` of them: `save` after the step that reached it, `restore` into a slot whose request
starts there; SCHEDULING.md 5).

`plan(metadata)` once per step, before the forward pass: it zeroes the starting rows' states and sorts
the rows into one-token decode rows (batched, their slots in a fixed index buffer that a captured CUDA
graph reads) and longer chunks (one request at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.kernels.attention.base import AttentionMetadata


@dataclass(frozen=True)
class RecurrentShape:
    """One linear-attention layer's state per request."""

    conv_dim: int  # channels of the convolution: q | k | v
    conv_kernel: int  # K, of which a state keeps the last K - 1 inputs
    heads: int  # value heads, one state matrix each
    key_dim: int
    value_dim: int

    def of_ranks(self, world_size: int) -> RecurrentShape:
        """One tensor-parallel rank's share: its heads' channels and matrices (the heads split evenly)."""
        return RecurrentShape(
            conv_dim=self.conv_dim // world_size,
            conv_kernel=self.conv_kernel,
            heads=self.heads // world_size,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
        )

    def bytes_per_request(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        return conv + self.heads * self.key_dim * self.value_dim * 4


@dataclass
class StateChunk:
    """A row of more than one token: packed rows `start:start + length`, its slot's state."""

    start: int
    length: int
    slot: int


@dataclass(frozen=True)
class PackedChunks:
    """A step's chunks as packed sequences for the Triton kernels (`kernels.triton.gated_delta`): their bounds
    (int64 [chunks + 1], on the device and on the host) and their slots, made once a step for every layer (fla
    caches what it derives from the bounds by the tensor's identity)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    slots: torch.Tensor


class RecurrentStatePool:
    def __init__(
        self,
        *,
        num_layers: int,
        shape: RecurrentShape,
        max_running_requests: int,
        dtype: torch.dtype,
        device: torch.device,
        snapshots: int = 0,
    ):
        slots = max_running_requests + 1  # the last: padded rows' dummy
        self.shape = shape
        self.dummy_slot = max_running_requests
        self.conv = torch.zeros((num_layers, slots, shape.conv_dim, shape.conv_kernel - 1), dtype=dtype, device=device)
        self.matrix = torch.zeros(
            (num_layers, slots, shape.heads, shape.key_dim, shape.value_dim), dtype=torch.float32, device=device
        )
        # Snapshots of states at a cached prefix's end, which the prefix cache serves (`restore` / `save`)
        self.conv_snapshots = self.conv.new_zeros((num_layers, snapshots, *self.conv.shape[2:]))
        self.matrix_snapshots = self.matrix.new_zeros((num_layers, snapshots, *self.matrix.shape[2:]))
        self._index = torch.zeros(max(2 * slots, 64), dtype=torch.int64, device=device)
        self.decode_rows: torch.Tensor | None = None  # packed rows of the one-token rows; None: every row
        self.decode_slots = self._index[:0]  # their slots, a view of the fixed buffer
        self.chunks: list[StateChunk] = []
        self.packed: PackedChunks | None = None  # the chunks packed (None: no chunk this step)

    @property
    def bytes_per_request(self) -> int:
        """One slot's state over every linear layer."""
        return self.conv.shape[0] * self.shape.bytes_per_request(self.conv.dtype)

    @property
    def num_snapshots(self) -> int:
        return int(self.conv_snapshots.shape[1])

    @property
    def memory_bytes(self) -> int:
        tensors = (self.conv, self.matrix, self.conv_snapshots, self.matrix_snapshots)
        return sum(t.numel() * t.element_size() for t in tensors)

    def restore(self, moves: list[tuple[int, int]]) -> None:
        """Each (slot, snapshot): the slot's state becomes the snapshot's (before a step: a cached prefix's)."""
        for slot, snapshot in moves:
            self.conv[:, slot] = self.conv_snapshots[:, snapshot]
            self.matrix[:, slot] = self.matrix_snapshots[:, snapshot]

    def save(self, moves: list[tuple[int, int]]) -> None:
        """Each (slot, snapshot): the snapshot keeps the slot's state (after the step that reached it)."""
        for slot, snapshot in moves:
            self.conv_snapshots[:, snapshot] = self.conv[:, slot]
            self.matrix_snapshots[:, snapshot] = self.matrix[:, slot]

    def plan(self, metadata: AttentionMetadata) -> None:
        slots = np.asarray(metadata.slots, dtype=np.int64)
        if metadata.num_padding:
            slots[len(slots) - metadata.num_padding :] = self.dummy_slot
        prefix = np.asarray(metadata.prefix_lens, dtype=np.int64)
        extend = np.asarray(metadata.extend_lens, dtype=np.int64)
        starting = np.unique(slots[prefix == 0])
        if len(starting):
            fresh = torch.from_numpy(starting).to(self.conv.device)
            self.conv[:, fresh] = 0
            self.matrix[:, fresh] = 0
        starts = np.cumsum(extend) - extend
        one = extend == 1
        device = self.conv.device
        count = int(one.sum())
        if count > self._index.shape[0]:  # before any capture: graphs are captured at the largest size first
            self._index = torch.zeros(2 * count, dtype=torch.int64, device=device)
        self._index[:count].copy_(torch.from_numpy(slots[one]))
        self.decode_slots = self._index[:count]
        self.decode_rows = None if count == len(extend) else torch.from_numpy(starts[one]).to(device)
        self.chunks = [
            StateChunk(int(s), int(n), int(slot)) for s, n, slot in zip(starts[~one], extend[~one], slots[~one])
        ]
        self.packed = None
        if self.chunks:
            bounds = torch.from_numpy(np.concatenate(([0], np.cumsum(extend[~one]))))
            self.packed = PackedChunks(bounds.to(device), bounds, torch.from_numpy(slots[~one]).to(device))
