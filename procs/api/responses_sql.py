"""Stored responses in a database: `SqliteResponseStore` (the stdlib's `sqlite3`, a file the replicas of one
machine share and a restart keeps) and `PostgresResponseStore` (psycopg 3, a server the replicas of several
machines share), one schema and one set of rules (`SqlResponseStore`).

One row per response: its owner (a hash of the API key that created it), its creation and last use times,
its size, the response and its conversation as JSON. At most `max_entries` rows and `max_bytes` of JSON,
least recently used out first (each write checks, in its transaction), and rows older than `ttl_s` are
neither served nor kept (purged at most once a minute). SQLite runs in WAL mode (readers never wait for
the writer) with a busy timeout (a write waits for another replica's); PostgreSQL reconnects on the next
call after its connection breaks. Calls block for a local round trip (well under a millisecond for
SQLite; loadtests/bench_responses_store.py).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import msgspec

from batchserve.procs.api.schemas import ChatMessageIn
from batchserve.procs.api.stored_response import ResponseStoreError, StoredResponse

BUSY_TIMEOUT_S = 5.0  # a write waits this long for another replica's
CONNECT_TIMEOUT_S = 5
PURGE_EVERY_S = 60.0
COLUMNS = "(id, owner, created, last_used, size, response, history)"
UPSERT = (
    f"INSERT INTO responses {COLUMNS} VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
    "owner = excluded.owner, created = excluded.created, last_used = excluded.last_used, "
    "size = excluded.size, response = excluded.response, history = excluded.history"
)
INDEXES = [
    "CREATE INDEX IF NOT EXISTS responses_last_used ON responses (last_used)",
    "CREATE INDEX IF NOT EXISTS responses_created ON responses (created)",
]
log = logging.getLogger("batchserve.api")
_history = msgspec.json.Decoder(list[ChatMessageIn])


class SqlResponseStore(ABC):
    """The rules, over a DB-API connection that `_connect` makes (autocommit; transactions by hand)."""

    name: str
    PARAM = "?"  # the driver's placeholder
    BEGIN = "BEGIN"
    TABLE = ""  # CREATE TABLE responses ... in the dialect's types
    ERRORS: tuple[type[Exception], ...] = ()

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._lock = threading.Lock()  # one connection, used from the event loop (and tests' threads)
        self._purged_at = self._last_now = 0.0
        errors: tuple[type[Exception], ...] = (OSError, *self.ERRORS)
        try:
            self._db = self._connect()
            for statement in [self.TABLE, *INDEXES, "SELECT COUNT(*) FROM responses"]:
                self._db.execute(statement)
        except errors as exc:
            raise ResponseStoreError(f"responses store {self.name}: {str(exc).strip()}") from None

    @abstractmethod
    def _connect(self) -> Any:
        """A new connection, in autocommit mode."""

    def _sql(self, statement: str, params: tuple = ()) -> Any:
        return self._db.execute(statement.replace("?", self.PARAM), params)

    def put(self, rid: str, owner: str, response: dict[str, Any], history: list[ChatMessageIn]) -> bool:
        body, conversation = msgspec.json.encode(response), msgspec.json.encode(history)
        size = len(body) + len(conversation)
        if size > self.max_bytes:
            return False
        try:
            with self._lock:
                now = self._now()
                self._sql(self.BEGIN)
                try:
                    self._sql(UPSERT, (rid, owner, now, now, size, body, conversation))
                    self._evict(now)
                except BaseException:
                    self._sql("ROLLBACK")
                    raise
                self._sql("COMMIT")
        except self.ERRORS as exc:  # answered all the same, reported as not kept
            log.warning("a response was not stored", extra={"fields": {"store": self.name, "error": str(exc)}})
            self._reconnect()
            return False
        return True

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        try:
            with self._lock:
                now = self._now()
                row = self._sql(
                    "SELECT response, history, size FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                    (rid, owner, now - self.ttl_s),
                ).fetchone()
                if row is None:
                    return None
                self._sql("UPDATE responses SET last_used = ? WHERE id = ?", (now, rid))
        except self.ERRORS as exc:
            self._reconnect()
            raise ResponseStoreError(f"{self.name}: {exc}") from None
        return StoredResponse(msgspec.json.decode(bytes(row[0])), _history.decode(bytes(row[1])), row[2])

    def delete(self, rid: str, owner: str) -> bool:
        try:
            with self._lock:
                cursor = self._sql("DELETE FROM responses WHERE id = ? AND owner = ?", (rid, owner))
        except self.ERRORS as exc:
            self._reconnect()
            raise ResponseStoreError(f"{self.name}: {exc}") from None
        return cursor.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._sql("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @abstractmethod
    def _reconnect(self) -> None:
        """After a failed call: a new connection where the old one broke (the next call uses it)."""

    def _now(self) -> float:
        """The wall clock, strictly increasing here (two uses within a clock tick keep their order)."""
        self._last_now = max(time.time(), self._last_now + 1e-6)
        return self._last_now

    def _evict(self, now: float) -> None:
        """Rows past the age limit (at most once a minute), then the least recently used past the limits."""
        if now - self._purged_at >= PURGE_EVERY_S:
            self._purged_at = now
            self._sql("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
        count, total = self._sql("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        doomed = []
        if count > self.max_entries or total > self.max_bytes:
            for rid, size in self._sql("SELECT id, size FROM responses ORDER BY last_used, created").fetchall():
                if count <= self.max_entries and total <= self.max_bytes:
                    break
                doomed.append(rid)
                count, total = count - 1, total - size
        for rid in doomed:
            self._sql("DELETE FROM responses WHERE id = ?", (rid,))


class SqliteResponseStore(SqlResponseStore):
    BEGIN = "BEGIN IMMEDIATE"  # the write lock at once: a concurrent writer waits (busy timeout), never fails
    TABLE = (
        "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, "
        "last_used REAL NOT NULL, size INTEGER NOT NULL, response BLOB NOT NULL, history BLOB NOT NULL)"
    )
    ERRORS = (sqlite3.Error,)

    def __init__(self, path: str | Path, *, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.path = Path(path)
        self.name = f"sqlite:{self.path}"
        super().__init__(max_entries=max_entries, max_bytes=max_bytes, ttl_s=ttl_s)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        created = not self.path.exists()
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        if created:  # people's conversations: readable by the server's user alone (SQLite's -wal and -shm follow)
            os.chmod(self.path, 0o600)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _reconnect(self) -> None:
        """Nothing to do: a local file's connection does not break as a server's can; the next call uses it again."""


class PostgresResponseStore(SqlResponseStore):
    PARAM = "%s"
    TABLE = (
        "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
        "created DOUBLE PRECISION NOT NULL, last_used DOUBLE PRECISION NOT NULL, size BIGINT NOT NULL, "
        "response BYTEA NOT NULL, history BYTEA NOT NULL)"
    )

    def __init__(self, url: str, *, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        import psycopg

        self.url = url
        self.name = _without_password(url)
        self.ERRORS = (psycopg.Error,)
        super().__init__(max_entries=max_entries, max_bytes=max_bytes, ttl_s=ttl_s)

    def _connect(self) -> Any:
        import psycopg

        db = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        # as SQLite's WAL with synchronous=NORMAL: a commit does not wait for its flush to disk (a crash may
        # lose the last moments' responses, never the database's consistency)
        db.execute("SET synchronous_commit TO OFF")
        return db

    def _reconnect(self) -> None:
        if self._db.closed or self._db.broken:
            try:
                self._db = self._connect()
            except self.ERRORS:
                pass  # still down: the next call tries again


def _without_password(url: str) -> str:
    """A postgresql:// URL as errors and /health may show it."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
