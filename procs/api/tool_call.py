"""A tool call the api parsed out of a chat answer, as OpenAI's `tool_calls` entries shape it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)  # 24 hex digits


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
