"""OpenAI's response shapes for `/v1/completions` and `/v1/chat/completions`, whole and streamed.

A stream is: (chat only) a first chunk with `delta.role`, content chunks, one chunk with
`finish_reason` and an empty text/delta, and with `stream_options.include_usage` a last chunk with
empty `choices` and `usage` (all earlier chunks then carry `"usage": null`, as OpenAI's do).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import msgspec

from shared.messages import Usage

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class ResponseShapes(ABC):
    """Builds one request's JSON objects; `object`/`chunk_object` and the choice layout differ per endpoint."""

    object: str
    chunk_object: str

    def __init__(self, rid: str, model: str, include_usage: bool = False) -> None:
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def _envelope(self, obj_type: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.rid, "object": obj_type, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choice: dict) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start_chunk(self) -> dict[str, Any] | None:
        """The chunk sent before any text (chat: the role), or None."""
        return None

    @abstractmethod
    def text_chunk(self, text: str) -> dict[str, Any]: ...

    @abstractmethod
    def finish_chunk(self, finish_reason: str) -> dict[str, Any]: ...

    @abstractmethod
    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]: ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage_dict(usage)
        return chunk


class CompletionShapes(ResponseShapes):
    object = "text_completion"
    chunk_object = "text_completion"

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason})

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        obj = self._envelope(self.object, [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])
        obj["usage"] = usage_dict(usage)
        return obj


class ChatShapes(ResponseShapes):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def start_chunk(self) -> dict[str, Any]:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None})

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason})

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        obj = self._envelope(self.object, [{"index": 0, "message": {"role": "assistant", "content": text},
                                            "logprobs": None, "finish_reason": finish_reason}])
        obj["usage"] = usage_dict(usage)
        return obj
