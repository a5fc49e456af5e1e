"""The async twins honour the same contract: AsyncSqlStore (aiosqlite, psycopg, asyncmy),
AsyncRedisStore and AsyncIdempotency, on real services."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.drivers.redis import is_cluster
from idemq.guard.codec import DataclassCodec
from idemq.stores.base import ClaimRequest, Key
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, redis_cleanup, require_service, unique
from tests.contract.conftest import LEASE_CLOCK, FakeClock

ASYNC_SQL = ["sqlite", "postgres", "mariadb"]


async def make_async_store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest | None = None
) -> Any:
    if kind == "redis":
        require_service("redis")
        return idemq.AsyncRedisStore(
            REDIS_URL, prefix=unique("idemqtest"), ttl_s=600, lease_clock=LEASE_CLOCK
        )
    if kind == "redis-cluster":
        assert request is not None, "the redis-cluster store needs the test's request"
        cluster = request.getfixturevalue("redis_cluster")
        return idemq.AsyncRedisStore(
            cluster.url, prefix=unique("idemqtest"), ttl_s=600, lease_clock=LEASE_CLOCK
        )
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'async.db'}"
    else:
        require_service("postgres" if kind == "postgres" else "mysql")
        url = PG_URL if kind == "postgres" else MYSQL_URL
    store = idemq.AsyncSqlStore(url, table=unique("mi"), lease_clock=LEASE_CLOCK)
    await store.create_schema()
    return store


async def dispose(store: Any) -> None:
    if isinstance(store, idemq.AsyncSqlStore):
        await store.drop_schema()
    elif is_cluster(store.client):
        async for key in store.client.scan_iter(match=f"{store.prefix}*", count=1000):
            await store.client.delete(key)
    else:
        redis_cleanup(store.prefix)
    await store.close()


@pytest.fixture(params=ASYNC_SQL)
async def async_sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    store = await make_async_store(request.param, tmp_path)
    yield store
    await dispose(store)


@pytest.fixture(params=[*ASYNC_SQL, "redis", "redis-cluster"])
async def async_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    store = await make_async_store(request.param, tmp_path, request)
    yield store
    await dispose(store)


async def test_transactional_effect_commits_with_the_dedup_row(async_sql_store):
    ledger = sa.Table(unique("ledger"), sa.MetaData(), sa.Column("message_id", sa.String(128)))
    async with async_sql_store.engine.begin() as conn:
        await conn.run_sync(ledger.create)
    guard = idemq.AsyncIdempotency(async_sql_store, consumer="orders")
    assert guard.mode is idemq.Mode.TRANSACTIONAL

    async def pay(tx: Any) -> dict[str, int]:
        await tx.execute(ledger.insert().values(message_id="M"))
        return {"paid": 1}

    async def fail(tx: Any) -> None:
        await tx.execute(ledger.insert().values(message_id="F"))
        raise RuntimeError("after the write")

    try:
        first = await guard.process("M", pay)
        again = await guard.process("M", pay)
        with pytest.raises(RuntimeError):
            await guard.process("F", fail)
        async with async_sql_store.engine.connect() as conn:
            rows = (await conn.execute(sa.select(ledger.c.message_id))).scalars().all()
    finally:
        async with async_sql_store.engine.begin() as conn:
            await conn.run_sync(ledger.drop)
    assert first.status is idemq.Status.PROCESSED
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == {"paid": 1}
    assert rows == ["M"]
    assert await async_sql_store.get("F", "orders") is None


async def test_concurrent_duplicates_run_the_handler_once(async_store):
    mode = "lease" if isinstance(async_store, idemq.AsyncRedisStore) else None
    guard = idemq.AsyncIdempotency(async_store, consumer="orders", mode=mode)
    runs = 0

    async def handler(tx: Any) -> str:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.05)  # hold the claim while the twins arrive
        return "done"

    outcomes = await asyncio.gather(*(guard.process("M", handler) for _ in range(8)))
    assert runs == 1
    statuses = sorted(o.status.value for o in outcomes)
    assert statuses.count("processed") == 1
    assert set(statuses) <= {"processed", "duplicate", "in_progress"}


async def test_lease_takeover_and_late_complete(async_store):
    clock = FakeClock()
    guard = idemq.AsyncIdempotency(
        async_store, consumer="orders", mode="lease", lease_s=30, clock=clock
    )
    old = ClaimRequest(Key("orders", "M"), None, None, "a" * 32, clock(), 30_000)
    assert (await async_store.claim(old)).acquired
    assert (await guard.process("M", lambda tx: 1)).status is idemq.Status.IN_PROGRESS
    clock.advance(30_000)
    assert (await guard.process("M", lambda tx: 2)).result == 2
    with pytest.raises(idemq.LeaseLostError):
        await async_store.complete(Key("orders", "M"), "a" * 32, "3", clock())
    assert (await guard.process("M", lambda tx: 4)).result == 2


async def test_async_batch_and_invalid_ids(async_store):
    mode = "lease" if isinstance(async_store, idemq.AsyncRedisStore) else None
    guard = idemq.AsyncIdempotency(async_store, consumer="orders", mode=mode)

    async def handle(msg: idemq.Message, tx: Any) -> str:
        if msg.body == b"poison":
            raise ValueError("poison")
        return msg.id

    # "bad" ends the savepoint-free pass; "worse" then fails inside the isolated pass, after
    # its claim, which must be undone too.
    batch = [("a", b"x"), ("bad", b"poison"), ("a", b"x"), ("b", b"x"), ("worse", b"poison")]
    outcomes = await guard.process_batch(
        [idemq.Message(id=i, body=body) for i, body in batch], handle
    )
    assert [o.status.value for o in outcomes] == [
        "processed",
        "failed",
        "duplicate",
        "processed",
        "failed",
    ]
    with pytest.raises(idemq.InvalidMessageIdError):
        await guard.process("", lambda tx: None)
    assert await async_store.get("bad", "orders") is None
    assert await async_store.get("worse", "orders") is None
    retried = await guard.process_batch(
        [idemq.Message(id=i, body=b"fixed") for i in ("bad", "worse")], handle
    )
    assert [o.result for o in retried] == ["bad", "worse"]


async def test_async_options_typed_result_waiting_duplicate_and_cache(async_store):
    consumer = unique("c")
    options: dict[str, Any] = {"consumer": consumer, "mode": "lease", "codec": DataclassCodec(Paid)}
    holder = idemq.AsyncIdempotency(async_store, **options)
    waiter = idemq.AsyncIdempotency(async_store, wait_s=10, local_cache=10, **options)
    started, release = asyncio.Event(), asyncio.Event()
    runs: list[str] = []

    async def slow(_tx: Any) -> Paid:
        runs.append("holder")
        started.set()
        await release.wait()
        return Paid("o1", 10)

    first = asyncio.create_task(holder.process("M1", slow))
    await started.wait()
    asyncio.get_running_loop().call_later(0.2, release.set)
    duplicate = await waiter.process("M1", lambda _tx: runs.append("waiter"))
    assert (await first).result == Paid("o1", 10)
    assert duplicate.status is idemq.Status.DUPLICATE
    assert duplicate.result == Paid("o1", 10)  # replayed as the dataclass
    again = await waiter.process("M1", lambda _tx: runs.append("waiter"))
    assert again.result == Paid("o1", 10)
    assert waiter.cache is not None
    assert len(waiter.cache) == 1
    assert runs == ["holder"]


@dataclasses.dataclass(frozen=True)
class Paid:
    order_id: str
    cents: int
