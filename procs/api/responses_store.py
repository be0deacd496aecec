"""The stored responses behind `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

`store` (default true, as OpenAI's) keeps the answer and its conversation in a bounded in-memory
store (`ResponseStore`: least recently used out first), so `previous_response_id` continues it and
`GET /v1/responses/{id}` returns it until it is evicted or the server restarts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from procs.api.schemas import ChatMessageIn, FunctionCallIn, ToolCallIn

MAX_STORED_RESPONSES = 1024  # responses kept for previous_response_id and GET
MAX_STORED_BYTES = 64 * 1024 * 1024  # their JSON size, conversations included


@dataclass
class StoredResponse:
    response: dict[str, Any]
    history: list[ChatMessageIn]  # the conversation through this response's answer, without its instructions
    size: int


class ResponseStore:
    """Responses by id, at most `max_entries` and `max_bytes` of JSON: least recently used out first."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        """Keep it (False: larger than the whole store, not kept)."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(history))
        if size > self.max_bytes:
            return False
        self.delete(rid)
        self._entries[rid] = StoredResponse(response, history, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None


def history_message(output: list[dict[str, Any]]) -> ChatMessageIn:
    """The answer as the assistant message a follow-up turn continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [ToolCallIn(id=item["call_id"], function=FunctionCallIn(name=item["name"], arguments=item["arguments"]))
             for item in output if item["type"] == "function_call"]
    return ChatMessageIn(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)

