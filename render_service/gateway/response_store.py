"""Stored Responses (``store: true``), for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

A stored response is its JSON (what GET answers) and the conversation it ends as chat messages (its input after
the stored history it continued, then its own output as an assistant turn; ``instructions`` are not carried over,
as the Responses API defines). Two backends behind one interface:

* ``SqliteResponseStore`` (default): one embedded SQLite file (``--responses-store-path``), WAL mode so several
  worker processes of one gateway share it; calls run in a thread, never on the event loop. Retention is bounded:
  at most ``max_entries`` responses (oldest first out) and none older than ``ttl_s``; by bytes, a tenant's
  responses together at most ``tenant_bytes`` (its oldest first out, on every write) and everybody's at most
  ``max_bytes`` (the oldest first out, every 64 writes).

Every stored response has an owner, the tenant that created it (``splitserve_common/tenants.py``); reads and
deletes name the owner, and another tenant's response is simply not there. Ids are minted by the gateway.
* ``PostgresResponseStore`` (``--responses-store-dsn postgresql://...``): for several gateway replicas; the same
  table and retention, over an ``asyncpg`` pool opened lazily in the serving process.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgspec

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_TTL_S = 30 * 24 * 3600.0
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_TENANT_BYTES = 64 << 20
MAX_ID_CHARS = 256
PRUNE_EVERY = 64  # writes between two global retention passes


class StoreRefused(Exception):
    """A response too large to store (it is answered, not kept)."""


class StoredResponse(msgspec.Struct):
    response: msgspec.Raw  # the response object's JSON, as GET returns it
    history: list[dict[str, Any]]  # the conversation up to and including this response's output, as chat messages


class ResponseStore(Protocol):
    tenant_bytes: int  # what one tenant's responses may hold together (also the bound of one response)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


_encode = msgspec.json.Encoder().encode
_decode_history = msgspec.json.Decoder(list[dict[str, Any]]).decode


def _window_prune(table: str, placeholder: Callable[[int], str], by_owner: bool) -> str:
    """DELETE the rows past a byte bound, newest kept first (a running sum over ``created``)."""
    where = f"WHERE owner = {placeholder(1)}" if by_owner else ""
    bound = placeholder(2 if by_owner else 1)
    return (f"DELETE FROM {table} WHERE id IN (SELECT id FROM (SELECT id, SUM(size) OVER (ORDER BY created DESC, id) "
            f"AS running FROM {table} {where}) AS ranked WHERE running > {bound})")


def _check_bounds(max_entries: int, ttl_s: float, max_bytes: int, tenant_bytes: int) -> None:
    if max_entries < 1 or ttl_s <= 0 or max_bytes < 1 or tenant_bytes < 1:
        raise ValueError("--responses-store-max-entries, --responses-store-ttl, --responses-store-max-bytes and "
                         "--responses-store-tenant-bytes must be positive")


class SqliteResponseStore:
    # A table of its own: rows of the earlier owner-less table are never served (nobody can prove to own them).
    SCHEMA = ("CREATE TABLE IF NOT EXISTS owned_responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL "
              "NOT NULL, size INTEGER NOT NULL, response BLOB NOT NULL, history BLOB NOT NULL)")
    PRUNE_OWNER = _window_prune("owned_responses", lambda i: "?", True)
    PRUNE_ALL = _window_prune("owned_responses", lambda i: "?", False)

    def __init__(self, path: str | Path, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, tenant_bytes: int = DEFAULT_TENANT_BYTES) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.tenant_bytes = tenant_bytes
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
            conn.execute("CREATE INDEX IF NOT EXISTS owned_responses_created ON owned_responses (created)")
            conn.execute("CREATE INDEX IF NOT EXISTS owned_responses_owner ON owned_responses (owner, created)")
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db().execute("SELECT response, history, created FROM owned_responses WHERE id = ? AND "
                                     "owner = ?", (response_id, owner)).fetchone()
        if row is None or time.time() - row[2] > self.ttl_s:
            return None
        return StoredResponse(msgspec.Raw(bytes(row[0])), _decode_history(row[1]))

    def _put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        response, history = bytes(stored.response), _encode(stored.history)
        size = len(response) + len(history)
        if size > self.tenant_bytes:
            raise StoreRefused(f"{size} bytes, over the {self.tenant_bytes} a tenant may store")
        with self._lock:
            db = self._db()
            now = time.time()
            db.execute("INSERT OR IGNORE INTO owned_responses VALUES (?, ?, ?, ?, ?, ?)",  # never overwrites
                       (response_id, owner, now, size, response, history))
            db.execute(self.PRUNE_OWNER, (owner, self.tenant_bytes))  # this tenant's oldest beyond its bytes
            self._puts += 1
            if self._puts % PRUNE_EVERY == 1:
                self._prune(db, now)

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        """Retention: expired rows, then the oldest beyond the count, then the oldest beyond the bytes."""
        db.execute("DELETE FROM owned_responses WHERE created < ?", (now - self.ttl_s,))
        db.execute("DELETE FROM owned_responses WHERE id IN (SELECT id FROM owned_responses ORDER BY created DESC "
                   "LIMIT -1 OFFSET ?)", (self.max_entries,))
        db.execute(self.PRUNE_ALL, (self.max_bytes,))

    def _delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            return self._db().execute("DELETE FROM owned_responses WHERE id = ? AND owner = ?",
                                      (response_id, owner)).rowcount > 0

    def stored_bytes(self, owner: str | None = None) -> int:
        """What is stored (one tenant's, or everybody's), in bytes."""
        with self._lock:
            if owner is None:
                row = self._db().execute("SELECT COALESCE(SUM(size), 0) FROM owned_responses").fetchone()
            else:
                row = self._db().execute("SELECT COALESCE(SUM(size), 0) FROM owned_responses WHERE owner = ?",
                                         (owner,)).fetchone()
        return int(row[0])

    def prune(self) -> None:
        """Apply retention now (tests; puts do it every PRUNE_EVERY writes)."""
        with self._lock:
            self._prune(self._db(), time.time())

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, owner, response_id)

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        await asyncio.to_thread(self._put, owner, response_id, stored)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, owner, response_id)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class PostgresResponseStore:
    SCHEMA = ("CREATE TABLE IF NOT EXISTS splitserve_owned_responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
              "created DOUBLE PRECISION NOT NULL, size BIGINT NOT NULL, response BYTEA NOT NULL, "
              "history BYTEA NOT NULL)")
    PRUNE_OWNER = _window_prune("splitserve_owned_responses", lambda i: f"${i}", True)
    PRUNE_ALL = _window_prune("splitserve_owned_responses", lambda i: f"${i}", False)

    def __init__(self, dsn: str, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, tenant_bytes: int = DEFAULT_TENANT_BYTES) -> None:
        self.dsn = dsn
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.tenant_bytes = tenant_bytes
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
                        await conn.execute("CREATE INDEX IF NOT EXISTS splitserve_owned_responses_created "
                                           "ON splitserve_owned_responses (created)")
                        await conn.execute("CREATE INDEX IF NOT EXISTS splitserve_owned_responses_owner "
                                           "ON splitserve_owned_responses (owner, created)")
                    self._pool = pool
        return self._pool

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        pool = await self._db()
        row = await pool.fetchrow("SELECT response, history, created FROM splitserve_owned_responses WHERE id = $1 "
                                  "AND owner = $2", response_id, owner)
        if row is None or time.time() - row["created"] > self.ttl_s:
            return None
        return StoredResponse(msgspec.Raw(bytes(row["response"])), _decode_history(row["history"]))

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        response, history = bytes(stored.response), _encode(stored.history)
        size = len(response) + len(history)
        if size > self.tenant_bytes:
            raise StoreRefused(f"{size} bytes, over the {self.tenant_bytes} a tenant may store")
        pool = await self._db()
        await pool.execute("INSERT INTO splitserve_owned_responses VALUES ($1, $2, $3, $4, $5, $6) "
                           "ON CONFLICT (id) DO NOTHING",
                           response_id, owner, time.time(), size, response, history)
        await pool.execute(self.PRUNE_OWNER, owner, self.tenant_bytes)
        self._puts += 1
        if self._puts % PRUNE_EVERY == 1:
            await self.prune()

    async def prune(self) -> None:
        pool = await self._db()
        table = "splitserve_owned_responses"
        await pool.execute(f"DELETE FROM {table} WHERE created < $1", time.time() - self.ttl_s)
        await pool.execute(f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} ORDER BY created DESC "
                           "OFFSET $1)", self.max_entries)
        await pool.execute(self.PRUNE_ALL, self.max_bytes)

    async def delete(self, owner: str, response_id: str) -> bool:
        pool = await self._db()
        status = await pool.execute("DELETE FROM splitserve_owned_responses WHERE id = $1 AND owner = $2",
                                    response_id, owner)
        return bool(status.endswith(" 1"))

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def default_store_path() -> Path:
    from splitserve_common.cache_dir import cache_root

    return cache_root() / "responses.sqlite3"


def open_store(path: str | None, dsn: str | None, max_entries: int = DEFAULT_MAX_ENTRIES,
               ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
               tenant_bytes: int = DEFAULT_TENANT_BYTES) -> ResponseStore:
    """PostgreSQL when a DSN is given, else SQLite at ``path`` (default: the local cache directory)."""
    _check_bounds(max_entries, ttl_s, max_bytes, tenant_bytes)
    if dsn:
        return PostgresResponseStore(dsn, max_entries, ttl_s, max_bytes, tenant_bytes)
    return SqliteResponseStore(path or default_store_path(), max_entries, ttl_s, max_bytes, tenant_bytes)
