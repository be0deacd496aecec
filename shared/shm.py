"""Shared-memory arrays between processes: the sender writes, the message carries a `ShmRef`.

Two writers, both owned by the sending process, each safe to reuse by construction:

- `DoubleBuffer` for a step loop (scheduler -> worker batches, worker -> scheduler sampled ids):
  message k lives in half `k % 2`. The sender has at most two messages in flight: it writes
  message k + 2 only after the reply to message k arrived (the scheduler launches step k + 2 once
  step k is complete; the worker answers step k + 2 once it has received it), so the receiver no
  longer reads message k. The receiver maps the arrays without a copy.
- `SharedRing` for a stream (tokenizer -> scheduler prompt ids): allocations advance a write
  position; the receiver copies each array out on arrival and then publishes how far it has read
  in the segment's header (a read counter), which is what frees the space. A full ring never
  overwrites unread data: `put` returns None and the codec sends the array inline instead.

Segments are named `batchserve-<owner pid>-<purpose>` so that a supervisor can remove what a
killed process left in /dev/shm (`remove_segments_of`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Protocol

import numpy as np

from batchserve.shared.liveness import pid_gone

SEGMENT_PREFIX = "batchserve"
_ALIGN = 64  # cache-line aligned allocations
_RING_HEADER = 64  # the ring's header holds the reader's position (u64 at offset 0)


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where an array lives: `shape`/`dtype` at byte `offset` of segment `segment`.

    `release` is -1 for a borrowed view (double buffer), else the ring position the receiver
    publishes once it has copied the array out.
    """

    segment: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    release: int = -1


class ArrayWriter(Protocol):
    """What the codec's encoder needs from a shared-memory writer."""

    def start_message(self) -> None: ...

    def put(self, array: np.ndarray) -> ShmRef | None: ...


def segment_name(purpose: str, pid: int | None = None) -> str:
    return f"{SEGMENT_PREFIX}-{os.getpid() if pid is None else pid}-{purpose}"


def remove_segments_of(pid: int) -> list[str]:
    """Unlink every segment created by process `pid` (for a supervisor after the process died)."""
    removed: list[str] = []
    shm_dir = Path("/dev/shm")
    if not shm_dir.is_dir():
        return removed
    for path in shm_dir.glob(f"{SEGMENT_PREFIX}-{pid}-*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def remove_stale_segments() -> list[str]:
    """Unlink the segments of every process that is gone (what a killed process left behind; each
    process runs this at start, so a restarted stack cleans up after the one before it)."""
    shm_dir = Path("/dev/shm")
    if not shm_dir.is_dir():
        return []
    removed = []
    pids = {int(p.name.split("-")[1]) for p in shm_dir.glob(f"{SEGMENT_PREFIX}-*-*") if p.name.split("-")[1].isdigit()}
    for pid in sorted(pids):
        if pid_gone(pid):
            removed += remove_segments_of(pid)
    return removed


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _create(name: str, size: int) -> shared_memory.SharedMemory:
    try:  # a stale segment of a previous process with the same pid
        old = shared_memory.SharedMemory(name=name)
        old.close()
        old.unlink()
    except FileNotFoundError:
        pass
    return shared_memory.SharedMemory(name=name, create=True, size=size)


def _close(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    try:
        shm.close()
    except BufferError:  # arrays still view it; the mapping goes away with the process
        pass
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def _write(buf: memoryview, offset: int, array: np.ndarray) -> None:
    dst = np.ndarray(array.shape, dtype=array.dtype, buffer=buf, offset=offset)
    dst[...] = array


class DoubleBuffer:
    """Two halves, one per message, alternating (see the module docstring for why reuse is safe)."""

    def __init__(self, purpose: str, half_bytes: int = 4 << 20) -> None:
        self.half_bytes = _align(half_bytes)
        self.shm = _create(segment_name(purpose), 2 * self.half_bytes)
        self.name = self.shm.name
        self._messages = 0
        self._base = 0
        self._used = 0

    def start_message(self) -> None:
        self._base = (self._messages % 2) * self.half_bytes
        self._messages += 1
        self._used = 0

    def put(self, array: np.ndarray) -> ShmRef | None:
        size = _align(array.nbytes)
        if self._used + size > self.half_bytes:
            return None  # does not fit: the codec sends it inline
        offset = self._base + self._used
        buf = self.shm.buf
        assert buf is not None  # None once closed
        _write(buf, offset, array)
        self._used += size
        return ShmRef(self.name, offset, array.dtype.str, tuple(array.shape))

    def close(self) -> None:
        _close(self.shm, unlink=True)


class SharedRing:
    """A ring of variable-size arrays with a read counter in its header (one writer, one reader)."""

    def __init__(self, purpose: str, capacity_bytes: int = 16 << 20) -> None:
        self.capacity = _align(capacity_bytes)
        self.shm = _create(segment_name(purpose), _RING_HEADER + self.capacity)
        self.name = self.shm.name
        assert self.shm.buf is not None  # None once closed
        struct.pack_into("<Q", self.shm.buf, 0, 0)
        self.write_pos = 0  # monotonic byte position; the reader's position is in the header

    def start_message(self) -> None:
        pass

    @property
    def read_pos(self) -> int:
        buf = self.shm.buf
        assert buf is not None  # None once closed
        return struct.unpack_from("<Q", buf, 0)[0]

    def put(self, array: np.ndarray) -> ShmRef | None:
        size = _align(max(array.nbytes, 1))
        if size > self.capacity:
            return None
        start = self.write_pos
        if start % self.capacity + size > self.capacity:  # no room before the end: wrap
            start += self.capacity - start % self.capacity
        end = start + size
        if end - self.read_pos > self.capacity:
            return None  # the reader has not caught up: never overwrite unread data
        offset = _RING_HEADER + start % self.capacity
        buf = self.shm.buf
        assert buf is not None  # None once closed
        _write(buf, offset, array)
        self.write_pos = end
        return ShmRef(self.name, offset, array.dtype.str, tuple(array.shape), release=end)

    def close(self) -> None:
        _close(self.shm, unlink=True)


class ShmReader:
    """The receiving side: attaches segments by name (once) and turns `ShmRef`s into arrays."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def _segment(self, name: str) -> shared_memory.SharedMemory:
        shm = self._segments.get(name)
        if shm is None:
            shm = shared_memory.SharedMemory(name=name)
            # Python < 3.13 registers attached segments with this process's resource tracker, which
            # would unlink the owner's segment when we exit; the owner alone manages its lifetime.
            try:
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # private, untyped
            except Exception:
                pass
            self._segments[name] = shm
        return shm

    def array(self, ref: ShmRef) -> np.ndarray:
        shm = self._segment(ref.segment)
        view = np.ndarray(ref.shape, dtype=np.dtype(ref.dtype), buffer=shm.buf, offset=ref.offset)
        if ref.release < 0:
            return view  # borrowed: valid until the sender's next-but-one message
        owned = view.copy()
        del view
        buf = shm.buf
        assert buf is not None  # None once closed
        struct.pack_into("<Q", buf, 0, ref.release)  # frees the ring up to here
        return owned

    def close(self) -> None:
        for shm in self._segments.values():
            _close(shm, unlink=False)
        self._segments.clear()
