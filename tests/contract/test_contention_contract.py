"""Concurrent duplicates on the real stores: 50 coroutines on the same 100 keys, each key's effect
exactly once, and every call answered with its own key's result.

The coroutines are split over two guards on one store, as two consumer processes would be, so a
duplicate meets the claim both of its own guard (it waits for that call in-process) and of the
other guard (it waits through the store, or is answered IN_PROGRESS and delivered again). The
effect is a row in a business table on the same database (Redis: a list), counted per key.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, redis_cleanup, require_service, unique

COROUTINES = 50
KEYS = 100
REDELIVERY_S = 0.1  # a delivery answered IN_PROGRESS comes back this much later

Effect = Callable[[Any, str], Awaitable[None]]

pytestmark = pytest.mark.slow  # 50 coroutines on 100 keys of a real store: 5 to 70 s each


class Effects:
    """The business effect of one message, and how often each key's effect happened."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.name = unique("fx")
        self.table = sa.Table(
            self.name, sa.MetaData(), sa.Column("message_id", sa.String(128), nullable=False)
        )

    async def create(self) -> None:
        if isinstance(self.store, idemq.AsyncSqlStore):
            async with self.store.engine.begin() as conn:
                await conn.run_sync(self.table.create)

    async def apply(self, tx: Any, key: str) -> None:
        """The effect: inside the dedup transaction when ``tx`` is one, else on its own."""
        await asyncio.sleep(0.002)  # the handler takes a moment: duplicates meet a live claim
        if isinstance(self.store, idemq.AsyncRedisStore):
            await self.store.client.rpush(self.name, key)
        elif tx is not None:
            await tx.execute(self.table.insert().values(message_id=key))
        else:
            async with self.store.engine.begin() as conn:
                await conn.execute(self.table.insert().values(message_id=key))

    async def counts(self) -> Counter[str]:
        if isinstance(self.store, idemq.AsyncRedisStore):
            keys = await self.store.client.lrange(self.name, 0, -1)
            return Counter(key.decode() if isinstance(key, bytes) else key for key in keys)
        async with self.store.engine.connect() as conn:
            rows = await conn.execute(sa.select(self.table.c.message_id))
            return Counter(row[0] for row in rows)

    async def drop(self) -> None:
        if isinstance(self.store, idemq.AsyncSqlStore):
            async with self.store.engine.begin() as conn:
                await conn.run_sync(self.table.drop)
        else:
            await self.store.client.delete(self.name)


async def make_store(kind: str) -> Any:
    if kind == "redis":
        require_service("redis")
        return idemq.AsyncRedisStore(REDIS_URL, prefix=unique("idemqtest"), ttl_s=600)
    require_service("postgres" if kind == "postgres" else "mysql")
    url = PG_URL if kind == "postgres" else MYSQL_URL
    # Fewer connections than coroutines: waiting for the pool is part of contention.
    store = idemq.AsyncSqlStore(url, table=unique("mi"), pool_size=10, max_overflow=5)
    await store.create_schema()
    return store


@pytest.fixture
async def effects(request: pytest.FixtureRequest) -> AsyncIterator[Effects]:
    store = await make_store(request.param)
    made = Effects(store)
    await made.create()
    yield made
    await made.drop()
    if isinstance(store, idemq.AsyncSqlStore):
        await store.drop_schema()
    else:
        redis_cleanup(store.prefix)
    await store.close()


async def run_contention(effects: Effects, **options: Any) -> Counter[str]:
    """50 coroutines x the same 100 keys (in the same order) over two guards; a call answered
    IN_PROGRESS is delivered again (as the broker would, after a pause) until it is PROCESSED or
    DUPLICATE. Returns the answers; asserts each call got its own key's result."""
    consumer = unique("c")
    guards = [idemq.AsyncIdempotency(effects.store, consumer=consumer, **options) for _ in range(2)]
    keys = [f"K{i:03d}" for i in range(KEYS)]
    answers: Counter[str] = Counter()
    wrong: list[tuple[str, Any]] = []

    async def worker(n: int) -> None:
        guard = guards[n % 2]
        for key in keys:
            while True:

                async def handler(tx: Any, key: str = key) -> dict[str, str]:
                    await effects.apply(tx, key)
                    return {"key": key}

                outcome = await guard.process(key, handler)
                if outcome.status is not idemq.Status.IN_PROGRESS:
                    break
                answers["in_progress"] += 1
                await asyncio.sleep(REDELIVERY_S)
            answers[outcome.status.value] += 1
            if outcome.result != {"key": key}:
                wrong.append((key, outcome.result))

    await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(COROUTINES))), 240)
    assert wrong == []
    return answers


def assert_each_effect_once(counts: Counter[str], answers: Counter[str]) -> None:
    assert sorted(counts) == [f"K{i:03d}" for i in range(KEYS)]
    assert set(counts.values()) == {1}, {k: n for k, n in counts.items() if n != 1}
    assert answers["processed"] == KEYS
    assert answers["duplicate"] == KEYS * (COROUTINES - 1)


LEASE_KINDS = ["redis", "postgres", "mariadb"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("effects", LEASE_KINDS, indirect=True)
async def test_lease_mode_with_waiting_duplicates_runs_each_key_once(effects: Effects):
    answers = await run_contention(effects, mode="lease", lease_s=30, wait_s=10)
    assert_each_effect_once(await effects.counts(), answers)
    assert answers["in_progress"] == 0  # every duplicate waited for its result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("effects", LEASE_KINDS, indirect=True)
async def test_lease_mode_without_waiting_runs_each_key_once(effects: Effects):
    answers = await run_contention(effects, mode="lease", lease_s=30)
    assert_each_effect_once(await effects.counts(), answers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("effects", ["postgres", "mariadb"], indirect=True)
async def test_transactional_mode_runs_each_key_once(effects: Effects):
    answers = await run_contention(effects, mode="transactional")
    assert_each_effect_once(await effects.counts(), answers)


# -- the in-process wait: what it answers, and what it leaves to the store ----------------------


class CountingRedisStore(idemq.AsyncRedisStore):
    """The real Redis store, counting the claims that reach it."""

    claims = 0

    async def claim(self, request: Any) -> Any:
        self.claims += 1
        return await super().claim(request)


@pytest.fixture
async def redis_store() -> AsyncIterator[CountingRedisStore]:
    require_service("redis")
    store = CountingRedisStore(REDIS_URL, prefix=unique("idemqtest"), ttl_s=600)
    yield store
    redis_cleanup(store.prefix)
    await store.close()


async def test_waiting_duplicates_of_a_call_in_flight_ask_the_store_nothing(redis_store):
    guard = idemq.AsyncIdempotency(redis_store, consumer=unique("c"), mode="lease", wait_s=10)
    release = asyncio.Event()
    runs: list[str] = []

    async def slow(_tx: Any) -> dict[str, int]:
        runs.append("run")
        await release.wait()
        return {"n": 1}

    calls = [asyncio.create_task(guard.process("M1", slow)) for _ in range(20)]
    await asyncio.sleep(0.3)  # the 19 duplicates are waiting; a store poller would claim again
    claims_while_waiting = redis_store.claims
    release.set()
    outcomes = await asyncio.gather(*calls)
    assert runs == ["run"]
    assert claims_while_waiting == 1
    assert [o.status for o in outcomes].count(idemq.Status.DUPLICATE) == 19
    assert all(o.result == {"n": 1} for o in outcomes)
    first = next(o for o in outcomes if o.status is idemq.Status.PROCESSED)
    assert all(o.result is not first.result for o in outcomes if o is not first)  # own copies
    stored = await redis_store.get("M1", guard.consumer)
    assert stored is not None
    assert stored.status is idemq.RecordStatus.PROCESSED


async def test_a_waiter_never_takes_the_result_of_a_first_call_that_failed(redis_store):
    guard = idemq.AsyncIdempotency(redis_store, consumer=unique("c"), mode="lease", wait_s=10)
    started = asyncio.Event()
    runs: list[str] = []

    async def failing(_tx: Any) -> None:
        runs.append("first")
        started.set()
        await asyncio.sleep(0.2)
        raise RuntimeError("the first delivery failed")

    first = asyncio.create_task(guard.process("M1", failing))
    await started.wait()
    second = await guard.process("M1", lambda _tx: runs.append("second") or "ok")
    with pytest.raises(RuntimeError):
        await first
    assert second.status is idemq.Status.PROCESSED  # it ran itself, through the store
    assert second.result == "ok"
    assert runs == ["first", "second"]


async def test_a_waiter_with_another_payload_is_refused_at_once(redis_store):
    guard = idemq.AsyncIdempotency(redis_store, consumer=unique("c"), mode="lease", wait_s=10)
    release = asyncio.Event()

    async def slow(_tx: Any) -> str:
        await release.wait()
        return "ok"

    first = asyncio.create_task(guard.process("M1", slow, payload={"amount": 1}))
    await asyncio.sleep(0.1)
    with pytest.raises(idemq.PayloadMismatchError):
        await asyncio.wait_for(guard.process("M1", slow, payload={"amount": 2}), 2)
    same = asyncio.create_task(guard.process("M1", slow, payload={"amount": 1}))
    release.set()
    assert (await first).status is idemq.Status.PROCESSED
    assert (await same).status is idemq.Status.DUPLICATE


async def test_a_waiter_whose_wait_runs_out_is_answered_in_progress(redis_store):
    guard = idemq.AsyncIdempotency(redis_store, consumer=unique("c"), mode="lease", wait_s=0.3)
    release = asyncio.Event()

    async def slow(_tx: Any) -> str:
        await release.wait()
        return "ok"

    first = asyncio.create_task(guard.process("M1", slow))
    await asyncio.sleep(0.1)
    waited = await asyncio.wait_for(guard.process("M1", slow), 5)
    release.set()
    assert waited.status is idemq.Status.IN_PROGRESS
    assert waited.record is not None  # the store's answer: the first call's live claim
    assert (await first).status is idemq.Status.PROCESSED
