"""Concurrent duplicates: 50 coroutines on the same 100 keys, idemq's async guard vs idemkit 1.0.2.

Run:  python bench/contention.py [--rounds 5] [--only redis,postgres] [--handler-ms 2]

One turn of a contender: 100 fresh keys; 50 coroutines each run every key in the same order
(so on each key one coroutine claims and 49 meet a live claim) through one guard, i.e. 5,000
calls; the handler sleeps ``--handler-ms`` (the business effect) and returns ``{"key": key}``.
A turn counts only when the handler ran exactly once per key (100 runs) and every call came
back PROCESSED/DUPLICATE (idemkit: EXECUTED/REPLAYED) with its own key's result: anything else
stops the bench. Contenders, on Redis and on PostgreSQL:

* idemq ``AsyncIdempotency(mode="lease", wait_s=5)`` — a duplicate of a call in flight on the
  same guard waits for that call in-process; and the same over two guards on one store (half
  the coroutines each), where half the duplicates meet the other guard's claim and wait by
  re-claiming with backoff, as they would another process's;
* idemq transactional (PostgreSQL) — a duplicate blocks on the holder's row lock;
* idemkit ``IdempotentConsumer`` (``cache_result=True``, heartbeat on as its queue surface always
  runs it, ``wait_timeout_seconds=5``): duplicates wait on Pub/Sub or LISTEN/NOTIFY with a
  backed-off poll under it;
* bound: the same 5,000 calls as one bare read of the key each (``GET`` / a primary-key
  ``SELECT`` on the same pool) after one write per key — what any store-backed guard pays at
  least when every duplicate asks the store once.

Contenders take turns (order rotating) for ``--rounds`` rounds; a contender's rate is its calls
over its time. idemkit needs ``pip install 'idemkit[redis,postgres]==1.0.2'`` (not one of
idemq's dependencies); without it the bench says so and measures idemq alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import sqlalchemy as sa

import idemq

REDIS_URL = "redis://127.0.0.1:6379/0"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
IDEMQ_TABLE = "bench_contention_idemq"
IDEMQ_TX_TABLE = "bench_contention_idemq_tx"
IDEMKIT_TABLE = "bench_contention_idemkit"
BOUND_TABLE = "bench_contention_bound"
COROUTINES = 50
KEYS = 100
TWO_GUARDS = "idemq lease, wait_s=5, 2 guards"
POOL = 20  # connections per contender on PostgreSQL (idemkit's default max_size)


@dataclass
class Turn:
    """What one turn of a contender did, checked before its time counts."""

    runs: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)


Call = Callable[[str, Turn, int], Awaitable[None]]  # key, turn, coroutine number


@dataclass
class Contender:
    name: str
    make_call: Callable[[str], Call]  # per turn (its tag): the call for one key
    cleanup: Callable[[], Awaitable[None]]
    checked: bool = True  # False for the bound, which runs no handler


async def handler_for(key: str, turn: Turn, handler_s: float) -> dict[str, str]:
    turn.runs[key] += 1
    await asyncio.sleep(handler_s)
    return {"key": key}


def check(name: str, turn: Turn, keys: list[str]) -> None:
    """Exactly one handler run per key and every call answered with its own key's result."""
    wrong = {key: n for key, n in turn.runs.items() if n != 1}
    missing = [key for key in keys if key not in turn.runs]
    total = sum(turn.answers.values())
    if wrong or missing or sum(turn.runs.values()) != KEYS or total != KEYS * COROUTINES:
        raise AssertionError(
            f"{name}: {sum(turn.runs.values())} handler runs for {KEYS} keys "
            f"(twice: {list(wrong)[:5]}, never: {missing[:5]}), {total} answers"
        )
    bad = {answer: n for answer, n in turn.answers.items() if answer not in ("first", "dup")}
    if bad:
        raise AssertionError(f"{name}: calls not answered with their result: {bad}")


# -- idemq -------------------------------------------------------------------------------


def idemq_contender(name: str, guards: list[Any], handler_s: float, cleanup: Any) -> Contender:
    """Coroutine n calls ``guards[n % len(guards)]``: with two guards, half the duplicates meet
    the other guard's claim, as they would another process's."""

    def make_call(tag: str) -> Call:
        async def call(key: str, turn: Turn, n: int) -> None:
            guard = guards[n % len(guards)]
            outcome = await guard.process(
                key, lambda _tx: handler_for(key, turn, handler_s), business_id=None
            )
            ok = outcome.result == {"key": key}
            if outcome.status is idemq.Status.PROCESSED and ok:
                turn.answers["first"] += 1
            elif outcome.status is idemq.Status.DUPLICATE and ok:
                turn.answers["dup"] += 1
            else:
                turn.answers[f"{outcome.status.value} {outcome.result!r}"] += 1

        return call

    return Contender(name, make_call, cleanup)


# -- idemkit -------------------------------------------------------------------------------


def idemkit_contender(name: str, backend: Any, handler_s: float, cleanup: Any) -> Contender:
    from idemkit import IdempotentConsumer, QueueConfig  # noqa: PLC0415
    from idemkit.core.runner import RunStatus  # noqa: PLC0415

    current: list[Turn] = []  # the turn being run: its handler runs are counted there

    async def handle(message: dict[str, str]) -> dict[str, str]:
        return await handler_for(message["id"], current[-1], handler_s)

    consumer = IdempotentConsumer(
        backend=backend,
        config=QueueConfig(
            dedup_id=lambda m: m["id"],
            visibility_timeout_seconds=60,
            cache_result=True,
            wait_timeout_seconds=5,
        ),
        handler=handle,
    )

    def make_call(tag: str) -> Call:
        async def call(key: str, turn: Turn, n: int) -> None:
            if not current or current[-1] is not turn:
                current.append(turn)
            result = await consumer.dispatch({"id": key})
            ok = result.result == {"key": key}
            if result.status is RunStatus.EXECUTED and ok:
                turn.answers["first"] += 1
            elif result.status is RunStatus.REPLAYED and ok:
                turn.answers["dup"] += 1
            else:
                turn.answers[f"{result.status} {result.result!r}"] += 1

        return call

    return Contender(name, make_call, cleanup)


def idemkit_available() -> bool:
    try:
        import idemkit  # noqa: PLC0415
    except ImportError:
        return False
    return idemkit.__version__ == "1.0.2"


# -- the bound: one bare read per call ------------------------------------------------------


def redis_bound(client: aioredis.Redis) -> Contender:
    def make_call(tag: str) -> Call:
        async def call(key: str, turn: Turn, n: int) -> None:
            name = f"benchcont:bound:{tag}:{key}"
            if await client.get(name) is None:
                await client.set(name, '{"ok":true}', nx=True, ex=3600)

        return call

    async def cleanup() -> None:
        await _unlink(client, "benchcont:bound:*")

    return Contender("bound: bare GET per call", make_call, cleanup, checked=False)


def pg_bound(engine: Any) -> Contender:
    select = sa.text(f"SELECT r FROM {BOUND_TABLE} WHERE message_id = :k")
    insert = sa.text(
        f"INSERT INTO {BOUND_TABLE} (message_id, r) VALUES (:k, 'r') "
        "ON CONFLICT (message_id) DO NOTHING"
    )

    def make_call(tag: str) -> Call:
        async def call(key: str, turn: Turn, n: int) -> None:
            async with engine.connect() as conn:
                row = (await conn.execute(select, {"k": f"{tag}:{key}"})).first()
                if row is None:
                    await conn.execute(insert, {"k": f"{tag}:{key}"})
                await conn.commit()

        return call

    async def cleanup() -> None:
        async with engine.begin() as conn:
            await conn.execute(sa.text(f"DELETE FROM {BOUND_TABLE}"))

    return Contender("bound: bare SELECT per call", make_call, cleanup, checked=False)


# -- the turns ------------------------------------------------------------------------------


async def one_turn(contender: Contender) -> float:
    tag = uuid.uuid4().hex[:10]
    keys = [f"c{tag}-{i:03d}" for i in range(KEYS)]
    call = contender.make_call(tag)
    turn = Turn()

    async def worker(n: int) -> None:
        for key in keys:
            await call(key, turn, n)

    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(COROUTINES)))
    spent = time.perf_counter() - started
    if contender.checked:
        check(contender.name, turn, keys)
    await contender.cleanup()
    return spent


async def interleaved(contenders: list[Contender], rounds: int) -> dict[str, float]:
    """calls/s per contender: ``rounds`` turns each, the order rotating every round."""
    for contender in contenders:  # warm-up: connections, scripts, listeners
        await one_turn(contender)
    spent = dict.fromkeys((c.name for c in contenders), 0.0)
    order = list(contenders)
    for _ in range(rounds):
        order = order[1:] + order[:1]
        for contender in order:
            spent[contender.name] += await one_turn(contender)
    calls = rounds * KEYS * COROUTINES
    return {name: calls / seconds for name, seconds in spent.items()}


async def _unlink(client: aioredis.Redis, pattern: str) -> None:
    batch: list[Any] = [key async for key in client.scan_iter(match=pattern, count=5000)]
    for start in range(0, len(batch), 1000):
        await client.unlink(*batch[start : start + 1000])


# -- per backend ------------------------------------------------------------------------------


async def redis_contenders(
    handler_s: float, with_idemkit: bool
) -> tuple[list[Contender], Callable[[], Awaitable[None]]]:
    client = aioredis.Redis.from_url(REDIS_URL)
    await client.ping()
    store = idemq.AsyncRedisStore(client, prefix="benchcont:idemq", ttl_s=3600)
    guards = [
        idemq.AsyncIdempotency(store, consumer="bench", mode="lease", lease_s=30, wait_s=5)
        for _ in range(2)
    ]

    async def idemq_cleanup() -> None:
        await _unlink(client, "benchcont:idemq:*")

    contenders = [
        idemq_contender("idemq lease, wait_s=5", guards[:1], handler_s, idemq_cleanup),
        idemq_contender(TWO_GUARDS, guards, handler_s, idemq_cleanup),
        redis_bound(client),
    ]
    kit_client = None
    if with_idemkit:
        from idemkit import RedisBackend  # noqa: PLC0415

        kit_client = aioredis.Redis.from_url(REDIS_URL, decode_responses=False)
        backend = RedisBackend(kit_client, namespace="benchcont:idemkit")

        async def kit_cleanup() -> None:
            await _unlink(client, "benchcont:idemkit:*")

        contenders.insert(1, idemkit_contender("idemkit 1.0.2", backend, handler_s, kit_cleanup))

    async def close() -> None:
        await client.aclose()
        if kit_client is not None:
            await kit_client.aclose()

    return contenders, close


async def pg_contenders(
    handler_s: float, with_idemkit: bool
) -> tuple[list[Contender], Callable[[], Awaitable[None]]]:
    lease_store = idemq.AsyncSqlStore(PG_URL, table=IDEMQ_TABLE, pool_size=POOL, max_overflow=0)
    tx_store = idemq.AsyncSqlStore(PG_URL, table=IDEMQ_TX_TABLE, pool_size=POOL, max_overflow=0)
    bound_engine = lease_store.engine  # not used concurrently with the lease contender
    for store in (lease_store, tx_store):
        await store.drop_schema()
        await store.create_schema()
    async with bound_engine.begin() as conn:
        await conn.execute(sa.text(f"DROP TABLE IF EXISTS {BOUND_TABLE}"))
        await conn.execute(
            sa.text(f"CREATE TABLE {BOUND_TABLE} (message_id VARCHAR(128) PRIMARY KEY, r TEXT)")
        )
    lease = [
        idemq.AsyncIdempotency(lease_store, consumer="bench", mode="lease", lease_s=30, wait_s=5)
        for _ in range(2)
    ]
    transactional = idemq.AsyncIdempotency(tx_store, consumer="bench", mode="transactional")

    def deleting(store: idemq.AsyncSqlStore, table: str) -> Callable[[], Awaitable[None]]:
        async def cleanup() -> None:
            async with store.engine.begin() as conn:
                await conn.execute(sa.text(f"DELETE FROM {table}"))

        return cleanup

    contenders = [
        idemq_contender(
            "idemq lease, wait_s=5", lease[:1], handler_s, deleting(lease_store, IDEMQ_TABLE)
        ),
        idemq_contender(TWO_GUARDS, lease, handler_s, deleting(lease_store, IDEMQ_TABLE)),
        idemq_contender(
            "idemq transactional", [transactional], handler_s, deleting(tx_store, IDEMQ_TX_TABLE)
        ),
        pg_bound(bound_engine),
    ]
    backend = None
    if with_idemkit:
        from idemkit import PostgresBackend  # noqa: PLC0415
        from idemkit.backends.postgres import init_pg  # noqa: PLC0415

        async with bound_engine.begin() as conn:
            await conn.execute(sa.text(f"DROP TABLE IF EXISTS {IDEMKIT_TABLE}"))
        await init_pg(PG_DSN, table=IDEMKIT_TABLE)
        backend = PostgresBackend.from_url(PG_DSN, table=IDEMKIT_TABLE, max_size=POOL)
        contenders.insert(
            2,
            idemkit_contender(
                "idemkit 1.0.2", backend, handler_s, deleting(lease_store, IDEMKIT_TABLE)
            ),
        )

    async def close() -> None:
        if backend is not None:
            await backend.aclose()
        for store in (lease_store, tx_store):
            await store.engine.dispose()

    return contenders, close


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ratio(results: dict[str, float], a: str, b: str, target: float | None) -> None:
    if a not in results or b not in results:
        return
    value = results[a] / results[b]
    if target is None:
        print(f"  {a} / {b}: {value:.2f}x")
        return
    verdict = "ok" if value >= target else "BELOW TARGET"
    print(f"  {a} / {b}: {value:.2f}x (>= {target}x) {verdict}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="redis,postgres")
    parser.add_argument("--handler-ms", type=float, default=2.0)
    args = parser.parse_args()
    with_idemkit = idemkit_available()
    handler_s = args.handler_ms / 1000
    print(
        f"contention bench: {COROUTINES} coroutines x the same {KEYS} keys per turn, "
        f"{args.rounds} turns per contender, handler {args.handler_ms:g} ms"
    )
    if not with_idemkit:
        print("idemkit 1.0.2: not installed (pip install 'idemkit[redis,postgres]==1.0.2')")
    print(f"load average before: {_load()}")
    for backend in args.only.split(","):
        build = {"redis": redis_contenders, "postgres": pg_contenders}[backend]
        contenders, close = await build(handler_s, with_idemkit)
        try:
            results = await interleaved(contenders, args.rounds)
        finally:
            await close()
        print(f"{backend}:")
        for contender in contenders:
            rate = results[contender.name]
            print(f"  {contender.name:<30} {rate:>9,.0f} calls/s {1e6 / rate:8.1f} us/call")
        print("  ratios (target):")
        ratio(results, "idemq lease, wait_s=5", "idemkit 1.0.2", 1.2)
        ratio(results, TWO_GUARDS, "idemkit 1.0.2", None)
        ratio(results, "idemq transactional", "idemkit 1.0.2", None)
        bound = next(c.name for c in contenders if not c.checked)
        ratio(results, "idemq lease, wait_s=5", bound, None)
        ratio(results, "idemkit 1.0.2", bound, None)
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    asyncio.run(main())
