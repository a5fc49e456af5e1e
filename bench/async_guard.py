"""``AsyncIdempotency`` on PostgreSQL vs a hand-written asyncio loop on psycopg async.

The hand-written loop is :mod:`bench.sql_guard`'s raw loop on ``psycopg.AsyncConnection``: insert
the dedup row and, if it was new, the business UPDATE, in one transaction. idemq runs the same
UPDATE through ``tx.exec_driver_sql`` inside ``AsyncIdempotency.process``. Two passes each (first
delivery of N ids, then all N again); the contenders take turns, ``--repeat`` times, and the best
turn of each counts. Prints msg/s, client CPU µs per message (``time.process_time``) and the ratio.
A third contender, ``sa``, is the raw loop written on SQLAlchemy's asyncio engine instead of the
bare driver (``engine.begin()``, ``exec_driver_sql``; its own dedup table): what a hand-written
consumer whose handler takes an ``AsyncConnection``, as idemq's does, pays. SQLAlchemy's asyncio
layer hands each pool checkout, BEGIN, COMMIT and close to a greenlet.

    python bench/async_guard.py [--n 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

import idemq

PG_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
RAW_TABLE = "bench_async_idempotent_raw"
SA_TABLE = "bench_async_idempotent_sa"
IDEMQ_TABLE = "bench_async_idempotent"
ACCOUNTS = "bench_async_accounts"
UPDATE = f"UPDATE {ACCOUNTS} SET balance = balance - 1 WHERE id = %(id)s"


async def setup() -> idemq.AsyncSqlStore:
    store = idemq.AsyncSqlStore(PG_URL, table=IDEMQ_TABLE)
    await store.drop_schema()
    await store.create_schema()
    async with store.engine.begin() as conn:
        for statement in (
            f"DROP TABLE IF EXISTS {RAW_TABLE}",
            f"DROP TABLE IF EXISTS {SA_TABLE}",
            f"DROP TABLE IF EXISTS {ACCOUNTS}",
            *(
                f"CREATE TABLE {table} (message_id VARCHAR(128) PRIMARY KEY, "
                "business_id VARCHAR(64), status SMALLINT DEFAULT 0, processed_time TIMESTAMP, "
                "created_time TIMESTAMP DEFAULT CURRENT_TIMESTAMP)"
                for table in (RAW_TABLE, SA_TABLE)
            ),
            f"CREATE TABLE {ACCOUNTS} (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL)",
            f"INSERT INTO {ACCOUNTS} (id, balance) VALUES (1, 1000000000)",
        ):
            await conn.exec_driver_sql(statement)
    return store


async def reset(store: idemq.AsyncSqlStore) -> None:
    async with store.engine.begin() as conn:
        await conn.exec_driver_sql(f"DELETE FROM {RAW_TABLE}")
        await conn.exec_driver_sql(f"DELETE FROM {SA_TABLE}")
        await conn.exec_driver_sql(f"DELETE FROM {IDEMQ_TABLE}")


async def raw_loop(ids: list[str]) -> None:
    insert = (
        f"INSERT INTO {RAW_TABLE} (message_id, business_id, status, processed_time) "
        "VALUES (%s, %s, 1, now()) ON CONFLICT (message_id) DO NOTHING"
    )
    async with await psycopg.AsyncConnection.connect(PG_DSN) as conn:
        cur = conn.cursor()
        for message_id in ids:
            await cur.execute(insert, (message_id, message_id[:64]))
            if cur.rowcount == 1:
                await cur.execute(UPDATE, {"id": 1})
            await conn.commit()


def sqlalchemy_loop(store: idemq.AsyncSqlStore) -> Callable[[list[str]], Awaitable[None]]:
    insert = (
        f"INSERT INTO {SA_TABLE} (message_id, business_id, status, processed_time) "
        "VALUES (%s, %s, 1, now()) ON CONFLICT (message_id) DO NOTHING"
    )
    params = {"id": 1}

    async def loop(ids: list[str]) -> None:
        for message_id in ids:
            async with store.engine.begin() as conn:
                inserted = await conn.exec_driver_sql(insert, (message_id, message_id[:64]))
                if inserted.rowcount == 1:
                    await conn.exec_driver_sql(UPDATE, params)

    return loop


def idemq_loop(store: idemq.AsyncSqlStore) -> Callable[[list[str]], Awaitable[None]]:
    guard = idemq.AsyncIdempotency(store, consumer="bench-async")
    params = {"id": 1}

    async def handler(tx: AsyncConnection) -> None:
        await tx.exec_driver_sql(UPDATE, params)

    async def loop(ids: list[str]) -> None:
        for message_id in ids:
            await guard.process(message_id, handler, business_id=message_id[:64])

    return loop


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="messages per pass")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    store = await setup()
    ids = [f"ORDER_20240115143000{i % 1000:03d}_NODE01_{i:06d}" for i in range(args.n)]
    loops = {"raw": raw_loop, "idemq": idemq_loop(store), "sa": sqlalchemy_loop(store)}
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for _ in range(args.repeat):
        await reset(store)
        for contender, loop in loops.items():
            for phase in ("first", "duplicates"):
                wall, cpu = time.perf_counter(), time.process_time()
                await loop(ids)
                taken = (time.perf_counter() - wall, time.process_time() - cpu)
                key = (contender, phase)
                best[key] = min(best.get(key, taken), taken)
    await store.engine.dispose()
    print(
        f"{'pass':<12}{'raw msg/s':>10}{'cpu us':>8}{'idemq msg/s':>12}{'cpu us':>8}{'ratio':>7}"
        f"{'sa msg/s':>10}{'cpu us':>8}{'sa':>7}{'idemq/sa':>9}"
    )
    for phase in ("first", "duplicates"):
        (raw_s, raw_cpu), (our_s, our_cpu) = best["raw", phase], best["idemq", phase]
        sa_s, sa_cpu = best["sa", phase]
        print(
            f"{phase:<12}{args.n / raw_s:>10,.0f}{1e6 * raw_cpu / args.n:>8.0f}"
            f"{args.n / our_s:>12,.0f}{1e6 * our_cpu / args.n:>8.0f}{raw_s / our_s:>6.2f}x"
            f"{args.n / sa_s:>10,.0f}{1e6 * sa_cpu / args.n:>8.0f}{raw_s / sa_s:>6.2f}x"
            f"{sa_s / our_s:>8.2f}x"
        )
    print(
        "cpu us: client CPU per message (this process); ratio: idemq msg/s / raw msg/s; "
        "sa: the raw loop on SQLAlchemy's asyncio engine, msg/s / raw msg/s"
    )


if __name__ == "__main__":
    asyncio.run(main())
