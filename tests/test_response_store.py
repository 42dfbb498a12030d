"""Stored Responses: the embedded SQLite store (owners, bounded retention by count, age and bytes, several
processes on one file) and the PostgreSQL store against a real server started from the distribution's packages
(skipped, with the reason, where they are not installed)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from render_service.gateway.response_store import (
    PostgresResponseStore,
    SqliteResponseStore,
    StoredResponse,
    StoreRefused,
    open_store,
)
from tests.pg_harness import postgres_or_skip

HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
ALICE, MALLORY = "key-alice", "key-mallory"


def stored(n: int, pad: int = 0) -> StoredResponse:
    return StoredResponse(msgspec.Raw(msgspec.json.encode({"id": f"resp_{n}", "n": n, "pad": "x" * pad})), HISTORY)


async def roundtrip(store) -> None:
    assert await store.get(ALICE, "resp_1") is None
    await store.put(ALICE, "resp_1", stored(1))
    got = await store.get(ALICE, "resp_1")
    assert msgspec.json.decode(bytes(got.response))["n"] == 1 and got.history == HISTORY
    assert await store.get(MALLORY, "resp_1") is None  # another tenant's response is not there for it
    await store.put(MALLORY, "resp_1", stored(2))  # nor can it be overwritten by sending its id
    assert msgspec.json.decode(bytes((await store.get(ALICE, "resp_1")).response))["n"] == 1
    assert await store.get(MALLORY, "resp_1") is None
    assert await store.delete(MALLORY, "resp_1") is False
    assert await store.delete(ALICE, "resp_1") is True
    assert await store.delete(ALICE, "resp_1") is False
    assert await store.get(ALICE, "resp_1") is None


def test_sqlite_roundtrip_and_bounded_retention(tmp_path):
    store = SqliteResponseStore(tmp_path / "r.sqlite3", max_entries=5, ttl_s=3600)
    asyncio.run(roundtrip(store))

    async def fill() -> None:
        for n in range(12):
            await store.put(ALICE, f"resp_{n}", stored(n))
            time.sleep(0.002)
    asyncio.run(fill())
    store.prune()
    kept = [n for n in range(12) if asyncio.run(store.get(ALICE, f"resp_{n}")) is not None]
    assert kept == list(range(7, 12))  # the newest five
    # another process's view of the same file (a second worker): the same rows
    other = SqliteResponseStore(tmp_path / "r.sqlite3", max_entries=5, ttl_s=3600)
    assert asyncio.run(other.get(ALICE, "resp_11")) is not None
    expired = SqliteResponseStore(tmp_path / "r.sqlite3", max_entries=5, ttl_s=0.001)
    assert asyncio.run(expired.get(ALICE, "resp_11")) is None  # past its time-to-live: gone for readers at once
    expired.prune()
    assert asyncio.run(store.get(ALICE, "resp_11")) is None


def test_sqlite_bytes_per_response_tenant_and_store(tmp_path):
    """One response over the tenant's bytes is refused; a tenant's oldest go when it passes its bytes, and
    another tenant's responses stay; everybody's oldest go past the store's bytes."""
    store = SqliteResponseStore(tmp_path / "b.sqlite3", tenant_bytes=10_000, max_bytes=25_000)

    async def run() -> None:
        with pytest.raises(StoreRefused):
            await store.put(ALICE, "big", stored(0, pad=20_000))
        assert await store.get(ALICE, "big") is None
        await store.put(ALICE, "alice_0", stored(0, pad=3000))
        for n in range(8):
            await store.put(MALLORY, f"m_{n}", stored(n, pad=3000))
            time.sleep(0.002)
        assert store.stored_bytes(MALLORY) <= 10_000
        assert [n for n in range(8) if await store.get(MALLORY, f"m_{n}") is not None] == [5, 6, 7]
        assert await store.get(ALICE, "alice_0") is not None  # another tenant's flood does not evict it
        for n in range(6):
            await store.put(f"key-{n}", f"o_{n}", stored(n, pad=3000))
            time.sleep(0.002)
        store.prune()
        assert store.stored_bytes() <= 25_000
        assert await store.get("key-5", "o_5") is not None  # the newest stay
        assert await store.get(ALICE, "alice_0") is None  # the oldest went first

    asyncio.run(run())


def test_open_store_picks_the_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path / "x.sqlite3"), None), SqliteResponseStore)
    assert isinstance(open_store(None, "postgresql://u@127.0.0.1/db"), PostgresResponseStore)
    with pytest.raises(ValueError):
        open_store(None, None, max_entries=0)
    with pytest.raises(ValueError):
        open_store(None, None, tenant_bytes=0)


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
        await a.put(ALICE, "resp_shared", stored(7))
        assert msgspec.json.decode(bytes((await b.get(ALICE, "resp_shared")).response))["n"] == 7
        assert await b.get(MALLORY, "resp_shared") is None
        for n in range(6):
            await a.put(ALICE, f"resp_{n}", stored(n))
        await a.prune()
        assert [n for n in range(6) if await b.get(ALICE, f"resp_{n}") is not None] == [3, 4, 5]
        small = PostgresResponseStore(postgres.dsn, tenant_bytes=10_000)
        for n in range(5):
            await small.put(MALLORY, f"pm_{n}", stored(n, pad=3000))
        assert [n for n in range(5) if await b.get(MALLORY, f"pm_{n}") is not None] == [2, 3, 4]
        for store in (a, b, small):
            await store.close()

    asyncio.run(run())
