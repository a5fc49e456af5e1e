"""SQLAlchemy's pool is the only pool: more callers than connections wait their turn, none fails.

``pool_size=5, max_overflow=0`` and 40 threads through ``Idempotency`` plus 40 coroutines through
``AsyncIdempotency``, all at once: every message is processed exactly once, and none fails with
StoreUnavailableError while a connection sits idle somewhere outside the pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

CALLERS = 40  # of each kind, against 5 connections per store
POOL = {"pool_size": 5, "max_overflow": 0, "pool_timeout": 10}
HOLD_S = 0.02  # each handler holds its connection this long, so callers queue for the pool


def url_for(backend: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'pool.db'}"
    require_service("postgres" if backend == "postgres" else "mysql")
    return PG_URL if backend == "postgres" else MYSQL_URL


@pytest.mark.parametrize("backend", ["postgres", "mariadb", "sqlite"])
def test_more_callers_than_connections_all_get_through(backend: str, tmp_path: Path) -> None:
    url = url_for(backend, tmp_path)
    table = unique("mi")
    store = idemq.SqlStore(url, table=table, **POOL)
    astore = idemq.AsyncSqlStore(url, table=table, **POOL)
    store.create_schema()
    effects = sa.Table(
        unique("effects"), sa.MetaData(), sa.Column("message_id", sa.String(128), nullable=False)
    )
    effects.create(store.engine)
    guard = idemq.Idempotency(store, consumer="pool")
    aguard = idemq.AsyncIdempotency(astore, consumer="pool")
    start = threading.Barrier(CALLERS + 1)
    failures: list[BaseException] = []

    def sync_handler(message_id: str) -> Any:
        def handler(tx: sa.Connection) -> None:
            tx.execute(effects.insert().values(message_id=message_id))
            time.sleep(HOLD_S)

        return handler

    def sync_caller(i: int) -> None:
        start.wait()
        try:
            guard.process(f"T{i}", sync_handler(f"T{i}"))
        except BaseException as exc:  # collected: the assertion below names them
            failures.append(exc)

    async def async_caller(i: int) -> None:
        async def handler(tx: Any) -> None:
            await tx.execute(effects.insert().values(message_id=f"C{i}"))
            await asyncio.sleep(HOLD_S)

        await aguard.process(f"C{i}", handler)

    async def coroutines() -> list[BaseException | None]:
        start.wait()  # released together with the threads
        try:
            return await asyncio.gather(
                *(async_caller(i) for i in range(CALLERS)), return_exceptions=True
            )
        finally:
            await astore.close()  # on this loop: its connections belong to it

    threads = [threading.Thread(target=sync_caller, args=(i,)) for i in range(CALLERS)]
    try:
        for thread in threads:
            thread.start()
        results = asyncio.run(coroutines())
        for thread in threads:
            thread.join(120)
        failures += [r for r in results if isinstance(r, BaseException)]

        assert not failures, f"{len(failures)} callers failed, e.g. {failures[0]!r}"
        with store.engine.connect() as conn:
            written = sorted(conn.execute(sa.select(effects.c.message_id)).scalars())
        expected = sorted([f"T{i}" for i in range(CALLERS)] + [f"C{i}" for i in range(CALLERS)])
        assert written == expected, "every message's effect committed exactly once"
        assert store.stats().processed == 2 * CALLERS
        assert guard.process("T0", sync_handler("T0")).status is idemq.Status.DUPLICATE
    finally:
        effects.drop(store.engine)
        store.drop_schema()
        store.close()
