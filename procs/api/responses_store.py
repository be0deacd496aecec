"""The stored responses behind `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

`store` (default true, as OpenAI's) keeps the answer and its conversation, so `previous_response_id`
continues it and `GET /v1/responses/{id}` returns it, for `--responses-ttl-s` (30 days, as OpenAI keeps
them) or until the limits push it out (least recently used first). Where, `--responses-store`:
- `sqlite:PATH` (`responses_sql.py`), the default in the state directory: shared by the replicas of one
  machine and kept across restarts;
- `postgresql://...` (`responses_sql.py`, psycopg 3): shared by replicas on several machines;
- `memory`: this api process's memory, gone at a restart (one replica's alone).
A stored response belongs to the API key that created it (`owner`: a hash of the key, never the key; ""
without keys): another key neither reads, continues nor deletes it. A store that cannot open is one
error at start naming it (`ResponseStoreError`); a write that fails later answers the request and reports
`store` false.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import msgspec

from batchserve.procs.api.responses_sql import PostgresResponseStore, SqliteResponseStore
from batchserve.procs.api.schemas import ChatMessageIn, FunctionCallIn, ToolCallIn
from batchserve.procs.api.stored_response import ResponseStoreError, StoredResponse

MAX_STORED_RESPONSES = 1024  # responses kept for previous_response_id and GET (memory)
MAX_STORED_BYTES = 64 * 1024 * 1024  # their JSON size, conversations included (memory)
MAX_DATABASE_RESPONSES = 1_000_000  # the same in SQLite or PostgreSQL, on disk
MAX_DATABASE_BYTES = 8 * 1024**3
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
STORE_FILE = "responses.sqlite3"
log = logging.getLogger("batchserve.api")


class ResponseStore(Protocol):
    name: str  # in errors and /health: "memory", "sqlite:PATH"

    def put(self, rid: str, owner: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        """Keep it (False: not kept: larger than the whole store, or the write failed)."""
        ...

    def get(self, rid: str, owner: str) -> StoredResponse | None: ...
    def delete(self, rid: str, owner: str) -> bool: ...
    def close(self) -> None: ...


def owner_of(api_key: str | None) -> str:
    """Whose a stored response is: a hash of the API key that created it ("" without keys)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


def state_dir() -> Path:
    """Where the server keeps state across restarts: systemd's StateDirectory (`STATE_DIRECTORY`), else
    $XDG_STATE_HOME/batchserve (~/.local/state/batchserve)."""
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd)
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "batchserve"


def open_response_store(spec: str, ttl_s: float) -> ResponseStore:
    """The store `spec` names ("" : SQLite in `state_dir()`); ResponseStoreError naming it when it cannot open."""
    if spec == "memory":
        return MemoryResponseStore()
    entries, size = MAX_DATABASE_RESPONSES, MAX_DATABASE_BYTES
    if spec.startswith(POSTGRES_SCHEMES):
        return PostgresResponseStore(spec, max_entries=entries, max_bytes=size, ttl_s=ttl_s)
    path = spec.removeprefix("sqlite:") if spec else state_dir() / STORE_FILE
    return SqliteResponseStore(path, max_entries=entries, max_bytes=size, ttl_s=ttl_s)


def serving_store(spec: str, ttl_s: float) -> ResponseStore:
    """The api's store: `open_response_store`, or where it cannot open, one error line naming it, and the
    api serves on without it (`UnavailableResponseStore`, which /health reports)."""
    try:
        return open_response_store(spec, ttl_s)
    except ResponseStoreError as exc:
        log.error(str(exc))
        return UnavailableResponseStore(exc)


class UnavailableResponseStore:
    """What a store that could not open leaves (the api serves on): nothing is kept, and reading a stored
    response fails naming the store (503)."""

    def __init__(self, error: ResponseStoreError) -> None:
        self.error = error
        self.name = f"unavailable ({error})"

    def put(self, rid: str, owner: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        return False

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        raise self.error

    def delete(self, rid: str, owner: str) -> bool:
        raise self.error

    def close(self) -> None:
        pass


class MemoryResponseStore:
    """Responses by id, at most `max_entries` and `max_bytes` of JSON: least recently used out first."""

    name = "memory"

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[str, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, owner: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(history))
        if size > self.max_bytes:
            return False
        self.delete(rid, owner)
        self._entries[rid] = (owner, StoredResponse(response, history, size))
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is None or entry[0] != owner:
            return None
        self._entries.move_to_end(rid)
        return entry[1]

    def delete(self, rid: str, owner: str) -> bool:
        entry = self._entries.get(rid)
        if entry is None or entry[0] != owner:
            return False
        del self._entries[rid]
        self.bytes -= entry[1].size
        return True

    def close(self) -> None:
        self._entries.clear()


def history_message(output: list[dict[str, Any]]) -> ChatMessageIn:
    """The answer as the assistant message a follow-up turn continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        ToolCallIn(id=item["call_id"], function=FunctionCallIn(name=item["name"], arguments=item["arguments"]))
        for item in output
        if item["type"] == "function_call"
    ]
    return ChatMessageIn(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)
