"""msgpack encoding of the `shared.messages` structs, with numpy arrays.

An `np.ndarray` field travels as a msgpack extension: a shared-memory reference
`(segment, offset, dtype, shape)` when the encoder has a shared-memory writer with room, else the
array's bytes inline. The decoder turns either back into an array.
"""

from __future__ import annotations

import struct
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from batchserve.shared.shm import ArrayWriter, ShmReader, ShmRef

T = TypeVar("T")

EXT_INLINE = 1  # payload: u16 header length, msgpack (dtype, shape), raw bytes
EXT_SHM = 2  # payload: msgpack (segment, offset, dtype, shape, release)

_header_encoder = msgspec.msgpack.Encoder()
_inline_header = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...]])
_shm_ref = msgspec.msgpack.Decoder(tuple[str, int, str, tuple[int, ...], int])


class Encoder:
    """Encodes messages; arrays go to `writer` (shared memory) when given and it has room."""

    def __init__(self, writer: ArrayWriter | None = None) -> None:
        self.writer = writer
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, message: Any) -> bytes:
        if self.writer is not None:
            self.writer.start_message()
        return self._encoder.encode(message)

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")

    def _encode_array(self, array: np.ndarray) -> msgspec.msgpack.Ext:
        if array.dtype.hasobject:
            raise TypeError("object arrays cannot be sent")
        array = np.ascontiguousarray(array)
        if self.writer is not None:
            ref = self.writer.put(array)
            if ref is not None:
                payload = (ref.segment, ref.offset, ref.dtype, list(ref.shape), ref.release)
                return msgspec.msgpack.Ext(EXT_SHM, _header_encoder.encode(payload))
        header = _header_encoder.encode((array.dtype.str, list(array.shape)))
        return msgspec.msgpack.Ext(EXT_INLINE, struct.pack("<H", len(header)) + header + array.tobytes())


class Decoder(Generic[T]):
    """Decodes messages of `type` (a struct or a tagged union); `reader` maps shared-memory refs."""

    def __init__(self, type: Any, reader: ShmReader | None = None) -> None:
        self.reader = reader
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=self._dec_hook)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_INLINE:
            (header_len,) = struct.unpack_from("<H", data, 0)
            dtype, shape = _inline_header.decode(data[2 : 2 + header_len])
            raw = bytearray(data[2 + header_len :])  # owned and writable (torch.from_numpy wants that)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        if code == EXT_SHM:
            if self.reader is None:
                raise msgspec.ValidationError("shared-memory array received by a decoder without a reader")
            segment, offset, dtype, shape, release = _shm_ref.decode(data)
            return self.reader.array(ShmRef(segment, offset, dtype, tuple(shape), release))
        raise msgspec.ValidationError(f"unknown msgpack extension {code}")

    @staticmethod
    def _dec_hook(type: Any, obj: Any) -> Any:
        if type is np.ndarray:
            if isinstance(obj, np.ndarray):
                return obj
            raise msgspec.ValidationError(f"expected an array, got {obj.__class__.__name__}")
        raise NotImplementedError(f"cannot decode {type}")
