"""Reading an OpenAI-compatible streaming response: server-sent-event lines into chunks, text and usage.

One reader for every client here: the bench client (aiohttp), the Locust user (requests) and the
end-to-end tests (urllib) feed it the response's lines as they arrive.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


def sse_data(raw: bytes | str) -> str | None:
    """The payload of one server-sent-events line (`data: ...`); None for any other line."""
    line = (raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw).strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def choice_text(choice: dict[str, Any]) -> str | None:
    """A streamed choice's `text` (completions) or `delta.content` (chat); None where it has neither."""
    text = choice.get("text")
    return (choice.get("delta") or {}).get("content") if text is None else text


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk adds over its choices; "" for role-only, usage-only or empty chunks."""
    return "".join(choice_text(choice) or "" for choice in chunk.get("choices") or [])


def carries_token(chunk: dict[str, Any]) -> bool:
    """Whether a chunk delivers generated tokens: any with text, and (as vLLM's benchmark counts them) one
    whose text is empty because its tokens have none of their own yet. Not a chat role chunk without text
    (a server that sends the first token with the role counts), a finish chunk without text, or the usage
    chunk."""
    for choice in chunk.get("choices") or []:
        text = choice_text(choice)
        if text:
            return True
        if text is not None and choice.get("finish_reason") is None and "role" not in (choice.get("delta") or {}):
            return True
    return False


@dataclass
class StreamReader:
    """Feed it the lines of a streaming response in order; `feed` says whether to read on.

    The stream ends at `[DONE]` or at an event carrying `error`. Timestamps are `time.perf_counter()`."""

    chunks: list[dict[str, Any]] = field(default_factory=list)  # every event's JSON, in order
    parts: list[str] = field(default_factory=list)  # the text of each chunk with content
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that `carries_token`
    usage: dict[str, Any] | None = None  # the usage chunk's (`stream_options.include_usage`)
    finish_reason: str | None = None  # the last one a choice gave
    error: str = ""  # an error event's `error`, as JSON
    done: bool = False  # `[DONE]` arrived

    def feed(self, raw: bytes | str) -> bool:
        """Take one line (raises `json.JSONDecodeError` for a malformed event); False once the stream ended."""
        now = time.perf_counter()
        data = sse_data(raw)
        if data is None:
            return True
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        self.chunks.append(chunk)
        if "error" in chunk:
            self.error = json.dumps(chunk["error"])
            return False
        text = chunk_text(chunk)
        if text:
            self.parts.append(text)
        if carries_token(chunk):
            self.chunk_times.append(now)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def failure(self) -> str:
        """Why the stream does not count as a success; "" when it does."""
        if self.error:
            return f"stream error: {self.error[:300]}"
        if not self.done:
            return "stream ended without [DONE]"
        if not self.chunk_times:
            return "no content in the stream"
        return ""
