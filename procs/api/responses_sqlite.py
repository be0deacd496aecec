"""`SqliteResponseStore`: stored responses in a SQLite file (the stdlib's `sqlite3`), shared by the
replicas of one machine and kept across restarts.

WAL journal (readers never wait for the one writer) and a busy timeout (a writer waits for another
replica's write instead of failing). One row per response: its owner (a hash of the API key that created
it), its creation and last use times, its size, the response and its conversation as JSON. Limits as the
memory store's: at most `max_entries` rows and `max_bytes` of JSON, least recently used out first, and
rows older than `ttl_s` are neither served nor kept (purged at most once a minute).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from procs.api.schemas import ChatMessageIn
from procs.api.stored_response import ResponseStoreError, StoredResponse

BUSY_TIMEOUT_S = 5.0  # a write waits this long for another replica's
PURGE_EVERY_S = 60.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    size INTEGER NOT NULL,
    response BLOB NOT NULL,
    history BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_last_used ON responses (last_used);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""
log = logging.getLogger("batchserve.api")
_history = msgspec.json.Decoder(list[ChatMessageIn])


class SqliteResponseStore:
    def __init__(self, path: str | Path, *, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.path = Path(path)
        self.name = f"sqlite:{self.path}"
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._lock = threading.Lock()  # one connection, used from the event loop (and tests' threads)
        self._purged_at = 0.0
        self._last_now = 0.0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._db.execute("SELECT COUNT(*) FROM responses").fetchone()
        except (OSError, sqlite3.Error) as exc:
            raise ResponseStoreError(f"responses store {self.name}: {exc}") from None

    def put(self, rid: str, owner: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        body, conversation = msgspec.json.encode(response), msgspec.json.encode(history)
        size = len(body) + len(conversation)
        if size > self.max_bytes:
            return False
        now = self._now()
        try:
            with self._lock, self._transaction():
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (rid, owner, now, now, size, body, conversation))
                self._evict(now)
        except sqlite3.Error as exc:  # answered all the same, reported as not kept
            log.warning("a response was not stored", extra={"fields": {"store": self.name, "error": str(exc)}})
            return False
        return True

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        now = self._now()
        try:
            with self._lock:
                row = self._db.execute("SELECT response, history, size FROM responses WHERE id = ? AND owner = ? "
                                       "AND created >= ?", (rid, owner, now - self.ttl_s)).fetchone()
                if row is None:
                    return None
                self._db.execute("UPDATE responses SET last_used = ? WHERE id = ?", (now, rid))
        except sqlite3.Error as exc:
            raise ResponseStoreError(f"{self.name}: {exc}") from None
        return StoredResponse(msgspec.json.decode(row[0]), _history.decode(row[1]), row[2])

    def delete(self, rid: str, owner: str) -> bool:
        try:
            with self._lock:
                cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (rid, owner))
        except sqlite3.Error as exc:
            raise ResponseStoreError(f"{self.name}: {exc}") from None
        return cursor.rowcount > 0

    def _now(self) -> float:
        """The wall clock, strictly increasing here (two uses within a clock tick keep their order)."""
        self._last_now = max(time.time(), self._last_now + 1e-6)
        return self._last_now

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self) -> Any:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an error): the insert and its evictions as one write."""
        db = self._db

        class _Transaction:
            def __enter__(self) -> None:
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, kind: Any, *_: Any) -> None:
                db.execute("ROLLBACK" if kind is not None else "COMMIT")

        return _Transaction()

    def _evict(self, now: float) -> None:
        """Rows past the age limit (at most once a minute), then the least recently used past the limits."""
        if now - self._purged_at >= PURGE_EVERY_S:
            self._purged_at = now
            self._db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
        count, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        if count <= self.max_entries and total <= self.max_bytes:
            return
        doomed = []
        for rid, size in self._db.execute("SELECT id, size FROM responses ORDER BY last_used, created"):
            if count <= self.max_entries and total <= self.max_bytes:
                break
            doomed.append((rid,))
            count, total = count - 1, total - size
        self._db.executemany("DELETE FROM responses WHERE id = ?", doomed)
