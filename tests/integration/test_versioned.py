"""versioned_update on SQLite, PostgreSQL and MariaDB: CAS, 8-worker race, fencing, async twin."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from examples.orders.schema import make_async_engine, make_engine
from sqlalchemy import BigInteger, Column, Engine, Integer, MetaData, String, Table, select
from sqlalchemy.orm import Session

from idemq.business.versioned import versioned_update, versioned_update_async
from idemq.errors import StoreError
from tests.conftest import unique

WORKERS = 8


@dataclass
class Db:
    engine: Engine
    url: str
    table: Table

    def row(self, key: str = "a1") -> tuple[Any, ...]:
        t = self.table.c
        with self.engine.connect() as c:
            return tuple(
                c.execute(
                    select(t.balance, t.version, t.fence_token, t.note).where(t.account_id == key)
                ).one()
            )

    def update(self, expected: int, values: dict[str, Any], **kw: Any) -> bool:
        with self.engine.begin() as conn:
            return versioned_update(
                conn, self.table.name, "account_id", "a1", expected, values, **kw
            )


@pytest.fixture
def db(sql_url: str) -> Iterator[Db]:
    md = MetaData()
    table = Table(
        unique("ver"),
        md,
        Column("account_id", String(64), primary_key=True),
        Column("balance", Integer, nullable=False),
        Column("version", Integer, nullable=False),
        Column("fence_token", BigInteger),
        Column("note", String(200)),
        Column("lock_token", BigInteger),
    )
    engine = make_engine(sql_url, **({} if sql_url.startswith("sqlite") else {"pool_size": 10}))
    md.create_all(engine)
    with engine.begin() as c:
        c.execute(table.insert().values(account_id="a1", balance=1000, version=0))
    try:
        yield Db(engine, sql_url, table)
    finally:
        md.drop_all(engine)
        engine.dispose()


def test_true_exactly_once_per_version(db: Db) -> None:
    assert db.update(0, {"balance": 900}) is True
    assert db.update(0, {"balance": 800}) is False  # a second writer that read version 0
    assert db.row() == (900, 1, None, None)
    assert db.update(1, {"balance": 800, "note": "x'); DROP TABLE t; --"}) is True
    assert db.row() == (800, 2, None, "x'); DROP TABLE t; --")


def test_missing_key_is_false(db: Db) -> None:
    with db.engine.begin() as conn:
        assert not versioned_update(conn, db.table.name, "account_id", "zz", 0, {"balance": 1})
    assert db.row() == (1000, 0, None, None)


def test_empty_values_only_bump_the_version(db: Db) -> None:
    assert db.update(0, {}) is True
    assert db.row() == (1000, 1, None, None)


def test_rolled_back_update_keeps_the_version(db: Db) -> None:
    with db.engine.connect() as conn:
        trans = conn.begin()
        assert versioned_update(conn, db.table.name, "account_id", "a1", 0, {"balance": 1})
        trans.rollback()
    assert db.row() == (1000, 0, None, None)
    assert db.update(0, {"balance": 900}) is True


def test_fenced_write_with_older_token_is_refused(db: Db) -> None:
    assert db.update(0, {"balance": 900}, fence=7) is True
    assert db.row() == (900, 1, 7, None)
    # A paused ex-holder of the lock (token 6) read version 1 too: refused although the
    # version matches.
    assert db.update(1, {"balance": 0}, fence=6) is False
    assert db.row() == (900, 1, 7, None)
    assert db.update(1, {"balance": 850}, fence=7) is True  # same holder again
    assert db.update(2, {"balance": 800}, fence=8) is True  # a newer holder
    assert db.row() == (800, 3, 8, None)
    assert db.update(3, {"balance": 700}) is True  # an unfenced write leaves the token alone
    assert db.row() == (700, 4, 8, None)


def test_custom_fence_column(db: Db) -> None:
    assert db.update(0, {"balance": 900}, fence=3, fence_column="lock_token") is True
    assert db.update(1, {"balance": 800}, fence=2, fence_column="lock_token") is False
    with db.engine.connect() as c:
        assert c.execute(select(db.table.c.lock_token)).scalar_one() == 3
    assert db.row() == (900, 1, None, None)  # the default fence column was not touched


def test_database_errors_are_translated_with_cause(db: Db) -> None:
    with pytest.raises(StoreError) as info, db.engine.begin() as conn:
        versioned_update(conn, db.table.name, "account_id", "a1", 0, {"no_such_col": 1})
    assert type(info.value.__cause__).__module__.startswith("sqlalchemy")


@pytest.mark.slow
def test_racing_writers_exactly_one_wins(db: Db) -> None:
    barrier = threading.Barrier(WORKERS)
    wins: list[bool] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with db.engine.connect() as conn:
                barrier.wait(timeout=30)  # everyone read version 0 and now races to write it
                with conn.begin():
                    won = versioned_update(
                        conn, db.table.name, "account_id", "a1", 0, {"balance": 1000 - 10 * n}
                    )
                    if won:
                        time.sleep(0.05)  # hold the row lock so the others queue behind it
                wins.append(won)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(wins) == [False] * (WORKERS - 1) + [True]
    balance, version, _, _ = db.row()
    assert version == 1
    assert balance in {1000 - 10 * n for n in range(WORKERS)}


async def test_async_twin(db: Db) -> None:
    engine = make_async_engine(db.url)
    name = db.table.name
    try:
        async with engine.begin() as conn:
            assert await versioned_update_async(conn, name, "account_id", "a1", 0, {"balance": 5})
            assert not await versioned_update_async(
                conn, name, "account_id", "a1", 0, {"balance": 6}
            )
            assert await versioned_update_async(
                conn, name, "account_id", "a1", 1, {"balance": 7}, fence=4
            )
            assert not await versioned_update_async(
                conn, name, "account_id", "a1", 2, {"balance": 8}, fence=3
            )
        assert db.row() == (7, 2, 4, None)

        async def racer(n: int) -> bool:
            async with engine.begin() as conn:
                return await versioned_update_async(
                    conn, name, "account_id", "a1", 2, {"balance": 100 + n}
                )

        results = await asyncio.gather(*(racer(n) for n in range(4)))
        assert results.count(True) == 1
    finally:
        await engine.dispose()
    assert db.row()[1] == 3


def test_orm_sessions_and_value_columns_per_call(db: Db) -> None:
    """A Session runs the CAS in its transaction; each set of value columns writes only its own
    (statements are built once per kind of call)."""
    with Session(db.engine) as session, session.begin():
        assert versioned_update(session, db.table.name, "account_id", "a1", 0, {"balance": 900})
        assert versioned_update(session, db.table.name, "account_id", "a1", 1, {"note": "n"})
        assert versioned_update(session, db.table.name, "account_id", "a1", 2, {}, fence=4)
        assert not versioned_update(session, db.table.name, "account_id", "a1", 2, {"note": "x"})
    assert db.row() == (900, 3, 4, "n")
