"""Stored Responses (``store: true``), for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

A stored response is its JSON (what GET answers) and the conversation it ends as chat messages (its input after
the stored history it continued, then its own output as an assistant turn; ``instructions`` are not carried over,
as the Responses API defines). Two backends behind one interface:

* ``SqliteResponseStore`` (default): one embedded SQLite file (``--responses-store-path``), WAL mode so several
  worker processes of one gateway share it; calls run in a thread, never on the event loop. Retention is bounded:
  at most ``max_entries`` responses (oldest first out) and none older than ``ttl_s``.
* ``PostgresResponseStore`` (``--responses-store-dsn postgresql://...``): for several gateway replicas; the same
  table and retention, over an ``asyncpg`` pool opened lazily in the serving process.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import msgspec

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_TTL_S = 30 * 24 * 3600.0
MAX_ID_CHARS = 256


class StoredResponse(msgspec.Struct):
    response: msgspec.Raw  # the response object's JSON, as GET returns it
    history: list[dict[str, Any]]  # the conversation up to and including this response's output, as chat messages


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, response_id: str, stored: StoredResponse) -> None: ...

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...


_encode = msgspec.json.Encoder().encode
_decode_history = msgspec.json.Decoder(list[dict[str, Any]]).decode


class SqliteResponseStore:
    SCHEMA = ("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created REAL NOT NULL, "
              "response BLOB NOT NULL, history BLOB NOT NULL)")

    def __init__(self, path: str | Path, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._puts = 0

    def _db(self) -> sqlite3.Connection:
        import os

        if self._conn is None or self._pid != os.getpid():  # forked workers open their own connection
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=10, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(self.SCHEMA)
            conn.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db().execute("SELECT response, history, created FROM responses WHERE id = ?",
                                     (response_id,)).fetchone()
        if row is None or time.time() - row[2] > self.ttl_s:
            return None
        return StoredResponse(msgspec.Raw(bytes(row[0])), _decode_history(row[1]))

    def _put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            db = self._db()
            now = time.time()
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                       (response_id, now, bytes(stored.response), _encode(stored.history)))
            self._puts += 1
            if self._puts % 64 == 1:  # retention, amortized: expired rows, then the oldest beyond the bound
                db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
                db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC "
                           "LIMIT -1 OFFSET ?)", (self.max_entries,))

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def prune(self) -> None:
        """Apply retention now (tests; puts do it every 64 writes)."""
        with self._lock:
            db = self._db()
            db.execute("DELETE FROM responses WHERE created < ?", (time.time() - self.ttl_s,))
            db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC "
                       "LIMIT -1 OFFSET ?)", (self.max_entries,))

    async def get(self, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, response_id)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await asyncio.to_thread(self._put, response_id, stored)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class PostgresResponseStore:
    SCHEMA = ("CREATE TABLE IF NOT EXISTS splitserve_responses (id TEXT PRIMARY KEY, created DOUBLE PRECISION NOT "
              "NULL, response BYTEA NOT NULL, history BYTEA NOT NULL)")

    def __init__(self, dsn: str, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.dsn = dsn
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._pool: Any = None
        self._opening: asyncio.Lock | None = None
        self._puts = 0

    async def _db(self) -> Any:
        if self._pool is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._pool is None:
                    import asyncpg

                    pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4)
                    async with pool.acquire() as conn:
                        await conn.execute(self.SCHEMA)
                        await conn.execute("CREATE INDEX IF NOT EXISTS splitserve_responses_created "
                                           "ON splitserve_responses (created)")
                    self._pool = pool
        return self._pool

    async def get(self, response_id: str) -> StoredResponse | None:
        pool = await self._db()
        row = await pool.fetchrow("SELECT response, history, created FROM splitserve_responses WHERE id = $1",
                                  response_id)
        if row is None or time.time() - row["created"] > self.ttl_s:
            return None
        return StoredResponse(msgspec.Raw(bytes(row["response"])), _decode_history(row["history"]))

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        pool = await self._db()
        now = time.time()
        await pool.execute(
            "INSERT INTO splitserve_responses VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO UPDATE SET "
            "created = EXCLUDED.created, response = EXCLUDED.response, history = EXCLUDED.history",
            response_id, now, bytes(stored.response), _encode(stored.history))
        self._puts += 1
        if self._puts % 64 == 1:
            await self.prune()

    async def prune(self) -> None:
        pool = await self._db()
        await pool.execute("DELETE FROM splitserve_responses WHERE created < $1", time.time() - self.ttl_s)
        await pool.execute("DELETE FROM splitserve_responses WHERE id IN (SELECT id FROM splitserve_responses "
                           "ORDER BY created DESC OFFSET $1)", self.max_entries)

    async def delete(self, response_id: str) -> bool:
        pool = await self._db()
        status = await pool.execute("DELETE FROM splitserve_responses WHERE id = $1", response_id)
        return bool(status.endswith(" 1"))

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def default_store_path() -> Path:
    from splitserve_common.cache_dir import cache_root

    return cache_root() / "responses.sqlite3"


def open_store(path: str | None, dsn: str | None, max_entries: int = DEFAULT_MAX_ENTRIES,
               ttl_s: float = DEFAULT_TTL_S) -> ResponseStore:
    """PostgreSQL when a DSN is given, else SQLite at ``path`` (default: the local cache directory)."""
    if max_entries < 1 or ttl_s <= 0:
        raise ValueError("--responses-store-max-entries and --responses-store-ttl must be positive")
    if dsn:
        return PostgresResponseStore(dsn, max_entries, ttl_s)
    return SqliteResponseStore(path or default_store_path(), max_entries, ttl_s)
