"""Typed ZeroMQ sockets between batchserve's processes, and where each one lives.

Every process binds one PULL socket for what it receives; senders connect PUSH sockets to it, so
processes may start in any order (ZeroMQ queues messages until the peer binds). One socket per
receiver keeps each sender's messages in order, which is why an abort travels the same socket as
its request and can never overtake it.

Topology (`Endpoints`, ipc:// paths in the runtime directory):

    api          --GenerateRequest|AbortRequest|AdapterUpdate--> tokenizer.sock (tokenizer binds)
    tokenizer    --TokenizedRequest|AbortRequest|AdapterUpdate--> scheduler.sock (scheduler binds)
    detokenizer  --AbortRequest (stop string matched)-->       scheduler.sock
    worker       --WorkerInfo (once, at startup)-->            scheduler.sock
    scheduler    --ForwardBatch-->                             worker.sock      (worker binds)
    worker       --StepResult-->                               steps.sock       (scheduler binds)
    scheduler    --TokenDelta-->                               detokenizer.sock (detokenizer binds)
    tokenizer, scheduler, detokenizer, worker
                 --TextDelta|RequestRejected|SchedulerStats|Heartbeat--> api.sock (api binds)
    scheduler    --BackendFailure (the worker stalled)-->      api.sock
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

import zmq
import zmq.asyncio

from batchserve.shared.codec import Decoder, Encoder
from batchserve.shared.messages import (
    AbortRequest,
    AdapterUpdate,
    ForwardBatch,
    GenerateRequest,
    RequestRejected,
    SchedulerStats,
    StepResult,
    TextDelta,
    TokenDelta,
    TokenizedRequest,
)
from batchserve.shared.process_messages import BackendFailure, Heartbeat, WorkerInfo
from batchserve.shared.shm import ArrayWriter, ShmReader
from batchserve.shared.tokenize_messages import DetokenizeAnswer, DetokenizeQuery, TokenizeAnswer, TokenizeQuery

T = TypeVar("T")

# What each receiving socket carries.
TokenizerInbox = GenerateRequest | AbortRequest | TokenizeQuery | DetokenizeQuery | AdapterUpdate
SchedulerInbox = TokenizedRequest | AbortRequest | WorkerInfo | AdapterUpdate
WorkerInbox = ForwardBatch
StepsInbox = StepResult
DetokenizerInbox = TokenDelta
ApiInbox = TextDelta | RequestRejected | SchedulerStats | Heartbeat | BackendFailure | TokenizeAnswer | DetokenizeAnswer

_HWM = 1_000_000  # messages queued per peer before send blocks: never in practice
_LINGER_MS = 2000  # how long close() waits for queued messages to leave


@dataclass(frozen=True)
class Endpoints:
    tokenizer: str
    scheduler: str
    worker: str
    steps: str
    detokenizer: str
    api: str

    @classmethod
    def in_dir(cls, runtime_dir: str | os.PathLike[str]) -> Endpoints:
        d = Path(runtime_dir)
        return cls(
            **{
                name: f"ipc://{d / (name + '.sock')}"
                for name in ("tokenizer", "scheduler", "worker", "steps", "detokenizer", "api")
            }
        )


def _configure(sock: zmq.Socket, kind: int) -> None:
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, _HWM)


@overload
def _open(ctx: zmq.asyncio.Context, kind: int, address: str, bind: bool) -> zmq.asyncio.Socket: ...
@overload
def _open(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket: ...
def _open(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    _configure(sock, kind)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class Sender(Generic[T]):
    """A PUSH socket that encodes messages (arrays through `writer`'s shared memory when given)."""

    def __init__(self, ctx: zmq.Context, address: str, *, bind: bool = False, writer: ArrayWriter | None = None):
        self.socket = _open(ctx, zmq.PUSH, address, bind)
        self.encoder = Encoder(writer)

    def send(self, message: T) -> None:
        self.socket.send(self.encoder.encode(message), copy=False)

    def close(self) -> None:
        self.socket.close()


class Receiver(Generic[T]):
    """A PULL socket that decodes messages of `type` (shared-memory arrays through `reader`)."""

    def __init__(
        self, ctx: zmq.Context, address: str, type: Any, *, bind: bool = True, reader: ShmReader | None = None
    ):
        self.socket = _open(ctx, zmq.PULL, address, bind)
        self.decoder: Decoder[T] = Decoder(type, reader if reader is not None else ShmReader())

    def recv(self, timeout_s: float | None = None) -> T | None:
        """The next message, or None when none arrives within `timeout_s` (None: wait forever)."""
        if timeout_s is not None and not self.socket.poll(int(timeout_s * 1000)):
            return None
        return self.decoder.decode(self.socket.recv(copy=False).buffer)

    def recv_ready(self) -> list[T]:
        """Every message already queued, without waiting."""
        out: list[T] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self.decoder.decode(frame.buffer))

    def close(self) -> None:
        self.socket.close()


class AsyncSender(Generic[T]):
    """`Sender` for asyncio code (the api)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, *, bind: bool = False):
        self.socket = _open(ctx, zmq.PUSH, address, bind)
        self.encoder = Encoder()

    async def send(self, message: T) -> None:
        await self.socket.send(self.encoder.encode(message), copy=False)

    def close(self) -> None:
        self.socket.close()


class AsyncReceiver(Generic[T]):
    """`Receiver` for asyncio code (the api)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, type: Any, *, bind: bool = True, reader: ShmReader | None = None
    ):
        self.socket = _open(ctx, zmq.PULL, address, bind)
        self.decoder: Decoder[T] = Decoder(type, reader if reader is not None else ShmReader())

    async def recv(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def close(self) -> None:
        self.socket.close()
