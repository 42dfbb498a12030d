"""Stored Responses: the embedded SQLite store (bounded retention, several processes on one file) and the
PostgreSQL store against a real server started from the distribution's packages (skipped, with the reason,
where they are not installed)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from render_service.gateway.response_store import (
    PostgresResponseStore,
    SqliteResponseStore,
    StoredResponse,
    open_store,
)
from tests.pg_harness import postgres_or_skip

HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def stored(n: int) -> StoredResponse:
    return StoredResponse(msgspec.Raw(msgspec.json.encode({"id": f"resp_{n}", "n": n})), HISTORY)


async def roundtrip(store) -> None:
    assert await store.get("resp_1") is None
    await store.put("resp_1", stored(1))
    got = await store.get("resp_1")
    assert msgspec.json.decode(bytes(got.response)) == {"id": "resp_1", "n": 1} and got.history == HISTORY
    await store.put("resp_1", stored(2))  # a replayed id replaces
    assert msgspec.json.decode(bytes((await store.get("resp_1")).response))["n"] == 2
    assert await store.delete("resp_1") is True
    assert await store.delete("resp_1") is False
    assert await store.get("resp_1") is None


def test_sqlite_roundtrip_and_bounded_retention(tmp_path):
    store = SqliteResponseStore(tmp_path / "r.sqlite3", max_entries=5, ttl_s=3600)
    asyncio.run(roundtrip(store))

    async def fill() -> None:
        for n in range(12):
            await store.put(f"resp_{n}", stored(n))
            time.sleep(0.002)
    asyncio.run(fill())
    store.prune()
    kept = [n for n in range(12) if asyncio.run(store.get(f"resp_{n}")) is not None]
    assert kept == list(range(7, 12))  # the newest five
    # another process's view of the same file (a second worker): the same rows
    other = SqliteResponseStore(tmp_path / "r.sqlite3", max_entries=5, ttl_s=3600)
    assert asyncio.run(other.get("resp_11")) is not None
    expired = SqliteResponseStore(tmp_path / "r.sqlite3", max_entries=5, ttl_s=0.001)
    assert asyncio.run(expired.get("resp_11")) is None  # past its time-to-live: gone for readers at once
    expired.prune()
    assert asyncio.run(store.get("resp_11")) is None


def test_open_store_picks_the_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path / "x.sqlite3"), None), SqliteResponseStore)
    assert isinstance(open_store(None, "postgresql://u@127.0.0.1/db"), PostgresResponseStore)
    with pytest.raises(ValueError):
        open_store(None, None, max_entries=0)


@pytest.fixture(scope="module")
def postgres():
    server = postgres_or_skip()
    yield server
    server.stop()


def test_postgres_roundtrip_shared_and_bounded(postgres):
    async def run() -> None:
        a = PostgresResponseStore(postgres.dsn, max_entries=3)
        b = PostgresResponseStore(postgres.dsn, max_entries=3)  # a second gateway replica
        await roundtrip(a)
        await a.put("resp_shared", stored(7))
        assert msgspec.json.decode(bytes((await b.get("resp_shared")).response))["n"] == 7
        for n in range(6):
            await a.put(f"resp_{n}", stored(n))
        await a.prune()
        assert [n for n in range(6) if await b.get(f"resp_{n}") is not None] == [3, 4, 5]
        await a.close()
        await b.close()

    asyncio.run(run())
