"""Tensor parallelism: the worker's ranks, their torch.distributed groups and the collectives the model's
layers (`procs.worker.models.layers`) and the step broadcast (`procs.worker.rank_steps`) use.

`--tensor-parallel-size N` runs N worker processes, one per device, over `--nnodes` machines; global rank =
node_rank * (N / nnodes) + local_rank (`shared.parallel.RankLayout`). Global rank 0 is the worker the
scheduler talks to; the others follow it (`rank_steps`). Two groups over the same ranks:
- the device group carries the layers' all-reduces and the logits' all-gather: NCCL on CUDA, gloo on
  the CPU (as vLLM's and SGLang's TP groups);
- the CPU group (gloo) carries the step broadcast and the start-up agreements (the KV pool's size),
  plain bytes and integers that NCCL would have to copy to a device first.
Joining and loading use only a CPU group with `dist_timeout_s`; `TensorParallel.start_serving` then
replaces it by both groups with `step_timeout_s`: a dead or hung rank fails every other rank's
collective within a step's time instead of leaving them waiting. A failed collective raises
`CollectiveError`.

World size 1 (the default) creates no group: every collective is the identity.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from batchserve.shared.config import ServerConfig
from batchserve.shared.parallel import STANDALONE_INIT_ADDR, RankLayout, split_init_addr

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class TensorParallel:
    """This rank's collectives over the worker's ranks. `collective_s` adds up the host time spent in
    the device group's collectives (on CUDA they are asynchronous: it then counts only the launches)."""

    def __init__(self, layout: RankLayout | None = None, device: torch.device | None = None) -> None:
        self.layout = layout or RankLayout(rank=0, world_size=1, local_rank=0, local_world_size=1)
        self.device = device or torch.device("cpu")
        self.device_group: ProcessGroup | None = None  # made by `start_serving`: no device collective runs before it
        self.cpu_group: ProcessGroup | None = None
        self.collective_s = 0.0
        self.step_timeout_s = 0.0  # the serving groups' timeout (`start_serving`)
        # whole experts per rank rather than a share of every expert (`procs.worker.models.moe`)
        self.expert_parallel = False

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_first(self) -> bool:
        """Global rank 0: the rank that talks to the scheduler and samples."""
        return self.layout.rank == 0

    # -- shapes ----------------------------------------------------------------------------------

    def split(self, size: int, what: str) -> slice:
        """This rank's share of `size` split evenly; ValueError naming `what` when it does not divide."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {self.world_size}")
        share = size // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first id, rows) of this rank's rows of a vocabulary split in equal shards of
        ceil(vocab / world); the last shard's rows past the vocabulary are padding."""
        rows = -(-vocab_size // self.world_size)
        return self.rank * rows, rows

    # -- collectives -----------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        if self.world_size > 1:
            started = time.perf_counter()
            try:
                torch.distributed.all_reduce(x, group=self.device_group)
            except RuntimeError as exc:
                raise CollectiveError.of(exc) from exc
            self.collective_s += time.perf_counter() - started
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, rank order."""
        if self.world_size == 1:
            return x
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            torch.distributed.all_gather(parts, x.contiguous(), group=self.device_group)
        except RuntimeError as exc:
            raise CollectiveError.of(exc) from exc
        self.collective_s += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        try:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as exc:
            raise CollectiveError.of(exc) from exc
        return int(t.item())

    def max_int(self, value: int) -> int:
        """The largest of every rank's `value`."""
        return -self.min_int(-value)

    def broadcast_bytes(self, payload: bytes | None, capacity: int) -> bytes:
        """Rank 0's `payload` on every rank (the others pass None). One broadcast of `capacity` bytes
        carries the length and a payload that fits; a longer one takes a second broadcast."""
        header = torch.zeros(capacity, dtype=torch.uint8)
        if payload is not None:
            length = len(payload)
            header[:8] = torch.frombuffer(bytearray(length.to_bytes(8, "little")), dtype=torch.uint8)
            head = payload[: capacity - 8]
            if head:
                header[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._broadcast(header)
        length = int.from_bytes(header[:8].numpy().tobytes(), "little")
        if length <= capacity - 8:
            return payload if payload is not None else header[8 : 8 + length].numpy().tobytes()
        rest = torch.empty(length - (capacity - 8), dtype=torch.uint8)
        if payload is not None:
            rest.copy_(torch.frombuffer(bytearray(payload[capacity - 8 :]), dtype=torch.uint8))
        self._broadcast(rest)
        if payload is not None:
            return payload
        return header[8:].numpy().tobytes() + rest.numpy().tobytes()

    def _broadcast(self, x: torch.Tensor) -> None:
        try:
            torch.distributed.broadcast(x, src=0, group=self.cpu_group)
        except RuntimeError as exc:
            raise CollectiveError.of(exc) from exc

    # -- lifetime --------------------------------------------------------------------------------

    def start_serving(self) -> None:
        """Replace the joining CPU group by the serving groups, whose collectives time out after
        `step_timeout_s` (collective: every rank calls it, once loading and the start-up agreements are
        done, before CUDA graphs capture the device group's collectives)."""
        if self.world_size > 1:
            joining = self.cpu_group
            timeout = timedelta(seconds=self.step_timeout_s)
            self.cpu_group = torch.distributed.new_group(backend="gloo", timeout=timeout)
            self.device_group = (
                torch.distributed.new_group(backend="nccl", timeout=timeout)
                if self.device.type == "cuda"
                else self.cpu_group
            )
            if joining is not None:
                torch.distributed.destroy_process_group(joining)

    def close(self) -> None:
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def rank_device(device: torch.device, layout: RankLayout) -> torch.device:
    """A rank's device: cuda:(base + its replica's first device + local_rank) for a CUDA `device` (base: its
    index, 0 if none)."""
    if device.type != "cuda" or not layout.picks_device:
        return device
    return torch.device("cuda", (device.index or 0) + layout.first_local_device + layout.local_rank)


def check_local_devices(device: torch.device, layout: RankLayout) -> None:
    """ValueError when this machine has fewer CUDA devices than its ranks take (`device`: this rank's,
    from `rank_device`). Every rank checks before joining, so that none waits for one that cannot start."""
    if device.type != "cuda" or not layout.picks_device:
        return
    first = (device.index or 0) - layout.local_rank
    count = torch.cuda.device_count()
    if first + layout.local_world_size > count:
        if layout.replicas > 1:
            raise ValueError(
                f"data_parallel_size {layout.replicas} puts replica {layout.replica} on cuda:{first}, "
                f"but this machine has {count} CUDA device(s)"
            )
        raise ValueError(
            f"tensor_parallel_size {layout.world_size} over nnodes {layout.world_size // layout.local_world_size} "
            f"runs {layout.local_world_size} worker ranks on this machine, on cuda:{first}.."
            f"cuda:{first + layout.local_world_size - 1}, but it has {count} CUDA device(s)"
        )


def join(
    config: ServerConfig, layout: RankLayout, device: torch.device, joining: Callable[[], object] | None = None
) -> TensorParallel:
    """Join the worker's process group (every rank calls this; each waits up to dist_timeout_s for the
    others) and limit this rank's CPU threads to its share of the machine's cores (one of every replica's
    ranks). `joining` is called just before the wait (this rank got that far)."""
    tp = TensorParallel(layout, device)
    tp.step_timeout_s = config.step_timeout_s
    tp.expert_parallel = config.enable_expert_parallel
    if not layout.picks_device:
        return tp
    check_local_devices(device, layout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // layout.cpu_shares))
    if layout.world_size == 1:
        return tp
    host, port = split_init_addr(config.dist_init_addr or STANDALONE_INIT_ADDR)
    if joining is not None:
        joining()
    timeout = timedelta(seconds=config.dist_timeout_s)
    try:
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=timeout,
        )
    except (RuntimeError, ValueError) as exc:  # torch's DistStoreError is a RuntimeError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__  # not c10d's C++ frames
        raise TensorParallelError(
            f"worker rank {layout.rank} of {layout.world_size} could not join the others at "
            f"{host}:{port} within {config.dist_timeout_s:g} s: {reason}"
        ) from None
    # Loading's one agreement (the KV pool's size) is a CPU collective: the device group waits for serving.
    tp.cpu_group = torch.distributed.new_group(backend="gloo", timeout=timeout)
    return tp


class TensorParallelError(RuntimeError):
    """The worker ranks could not form their group."""


class CollectiveError(RuntimeError):
    """A collective over the worker ranks failed: a rank is gone, or it hung past the group's timeout
    (gloo raises a plain RuntimeError for both, NCCL a `torch.distributed.DistError`)."""

    @classmethod
    def of(cls, exc: RuntimeError) -> CollectiveError:
        return cls(str(exc).strip() or type(exc).__name__)
