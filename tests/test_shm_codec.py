"""Shared-memory arrays and the msgpack codec: round trips, fallbacks and reuse safety."""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import numpy as np
import pytest

from batchserve.shared.codec import Decoder, Encoder
from batchserve.shared.messages import (
    AbortRequest,
    ForwardBatch,
    RequestParams,
    SamplingParams,
    StepResult,
    TokenizedRequest,
)
from batchserve.shared.shm import DoubleBuffer, SharedRing, ShmReader, remove_segments_of, segment_name


def make_batch(step: int, n: int) -> ForwardBatch:
    ids = np.arange(step, step + n, dtype=np.int32)
    return ForwardBatch(
        step=step,
        slots=[0],
        prefix_lens=[0],
        extend_lens=[n],
        sample_lens=[1],
        sampling=[SamplingParams(temperature=0.0)],
        sample_counts=[0],
        input_ids=ids,
        positions=np.arange(n, dtype=np.int32),
        kv_locs=ids + 100,
        page_table_slots=np.zeros(1, np.int32),
        page_table_cols=np.zeros(1, np.int32),
        page_table_pages=np.array([step + 1], np.int32),
    )


def assert_same_batch(a: ForwardBatch, b: ForwardBatch) -> None:
    for field in msgspec.structs.fields(ForwardBatch):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), field.name
        else:
            assert x == y, field.name


def test_inline_round_trip_of_every_array_dtype_and_shape():
    enc, dec = Encoder(), Decoder(StepResult)
    for array in (
        np.arange(5, dtype=np.int32),
        np.zeros((0,), np.int64),
        np.ones((2, 3), np.float32),
        np.arange(6, dtype=np.int16)[::2],
    ):  # non-contiguous input
        out = dec.decode(enc.encode(StepResult(step=3, next_token_ids=array)))
        assert out.step == 3 and out.next_token_ids.dtype == array.dtype
        assert out.next_token_ids.shape == array.shape and (out.next_token_ids == array).all()
        assert out.next_token_ids.flags.writeable  # torch.from_numpy wants writable arrays


def test_forward_batch_round_trip_through_double_buffer_is_a_view_of_shared_memory():
    buf = DoubleBuffer("test-db", half_bytes=1 << 16)
    try:
        enc, dec = Encoder(buf), Decoder(ForwardBatch, ShmReader())
        batch = make_batch(0, 1000)
        data = enc.encode(batch)
        assert len(data) < 600  # the arrays (12 kB) are references, not bytes
        out = dec.decode(data)
        assert_same_batch(batch, out)
        assert not out.input_ids.flags.owndata  # mapped, not copied
    finally:
        buf.close()


def test_double_buffer_never_overwrites_the_previous_message():
    """Step k+1 is written while the receiver may still read step k: the halves alternate."""
    buf = DoubleBuffer("test-db2", half_bytes=4096)
    try:
        enc, dec = Encoder(buf), Decoder(ForwardBatch, ShmReader())
        previous = dec.decode(enc.encode(make_batch(0, 16)))
        for step in range(1, 6):
            current = dec.decode(enc.encode(make_batch(step, 16)))
            assert_same_batch(make_batch(step - 1, 16), previous)  # untouched by this step's write
            assert_same_batch(make_batch(step, 16), current)
            previous = current
    finally:
        buf.close()


def test_oversized_arrays_fall_back_to_inline():
    buf = DoubleBuffer("test-db3", half_bytes=64)
    try:
        enc, dec = Encoder(buf), Decoder(ForwardBatch, ShmReader())
        batch = make_batch(0, 100)  # 400 bytes per array > half
        assert_same_batch(batch, dec.decode(enc.encode(batch)))
    finally:
        buf.close()


def request(rid: str, n: int) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, prompt_ids=np.arange(n, dtype=np.int32) + len(rid), params=RequestParams())


def test_ring_copies_out_and_frees_space_only_when_read():
    ring = SharedRing("test-ring", capacity_bytes=1024)
    try:
        enc, dec = Encoder(ring), Decoder(TokenizedRequest | AbortRequest, ShmReader())
        sent = [enc.encode(request(f"r{i}", 64)) for i in range(4)]  # 4 x 256 bytes: full
        assert ring.write_pos == 1024
        assert ring.put(np.zeros(64, np.int32)) is None  # full: nothing unread is overwritten
        first = dec.decode(sent[0])
        assert first.prompt_ids.flags.owndata and (first.prompt_ids == request("r0", 64).prompt_ids).all()
        assert ring.read_pos == 256
        late = enc.encode(request("late", 64))  # reuses the space the reader released
        for i, data in enumerate(sent[1:], 1):
            assert (dec.decode(data).prompt_ids == request(f"r{i}", 64).prompt_ids).all()
        assert (dec.decode(late).prompt_ids == request("late", 64).prompt_ids).all()
        # a full ring falls back to inline bytes rather than blocking or corrupting
        for i in range(5):
            data = enc.encode(request(f"x{i}", 64))
            assert (dec.decode(data).prompt_ids == request(f"x{i}", 64).prompt_ids).all()
    finally:
        ring.close()


def test_ring_wraps_around_without_splitting_an_array():
    ring = SharedRing("test-ring2", capacity_bytes=1024)
    try:
        enc, dec = Encoder(ring), Decoder(TokenizedRequest, ShmReader())
        for i, n in enumerate([100, 60, 150, 7, 200, 1, 90] * 5):
            out = dec.decode(enc.encode(request(f"r{i}", n)))
            assert (out.prompt_ids == request(f"r{i}", n).prompt_ids).all()
        assert ring.write_pos > 4 * ring.capacity
    finally:
        ring.close()


def _reader_process(name: str, conn) -> None:
    dec = Decoder(ForwardBatch, ShmReader())
    while True:
        data = conn.recv()
        if data is None:
            return
        batch = dec.decode(data)
        conn.send((batch.step, batch.input_ids.tolist(), batch.page_table_pages.tolist()))


def test_double_buffer_across_processes_step_loop():
    buf = DoubleBuffer("test-db4", half_bytes=4096)
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_reader_process, args=(buf.name, child))
    proc.start()
    try:
        enc = Encoder(buf)
        for step in range(6):
            parent.send(enc.encode(make_batch(step, 5)))
            got = parent.recv()
            assert got == (step, list(range(step, step + 5)), [step + 1])
        parent.send(None)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        buf.close()
        if proc.is_alive():
            proc.kill()


def test_remove_segments_of_a_dead_owner():
    ring = SharedRing("leak")
    try:
        assert segment_name("leak") in remove_segments_of(__import__("os").getpid())
    finally:
        ring.shm.close()


def test_stale_segments_of_dead_processes_are_removed_and_live_ones_kept():
    import subprocess
    import sys
    from pathlib import Path

    from batchserve.shared.shm import remove_stale_segments

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path("/dev/shm") / segment_name("stale", pid=dead.pid)
    stale.write_bytes(b"x")
    ring = SharedRing("alive")  # ours: this process runs
    try:
        removed = remove_stale_segments()
        assert stale.name in removed and not stale.exists()
        assert Path("/dev/shm", segment_name("alive")).exists()
    finally:
        stale.unlink(missing_ok=True)
        ring.close()


def test_unknown_extension_and_missing_reader_are_validation_errors():
    buf = DoubleBuffer("test-db5", half_bytes=4096)
    try:
        data = Encoder(buf).encode(StepResult(step=0, next_token_ids=np.zeros(2, np.int32)))
        with pytest.raises(msgspec.ValidationError):
            Decoder(StepResult).decode(data)
        bad = msgspec.msgpack.encode({"step": 0, "next_token_ids": msgspec.msgpack.Ext(9, b"x")})
        with pytest.raises(msgspec.ValidationError):
            Decoder(StepResult, ShmReader()).decode(bad)
    finally:
        buf.close()
