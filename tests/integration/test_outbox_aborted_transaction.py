"""PostgreSQL: ``Outbox.add`` into a transaction a swallowed error already aborted.

The row could never commit (the COMMIT of an aborted transaction rolls back), so ``add`` says
so as :class:`idemq.TransactionLostError` — a conflict: a guarded handler that lets it go is
run again in a fresh transaction by idemq — instead of the driver's "current transaction is
aborted". A transaction that has sent nothing yet (psycopg begins lazily) is not aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

import idemq
from tests.conftest import unique


@pytest.fixture
def setup(pg_url: str) -> Iterator[tuple[idemq.SqlStore, idemq.Outbox, sa.Table]]:
    store = idemq.SqlStore(pg_url, table=unique("mi"))
    store.create_schema()
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    refs = sa.Table(unique("refs"), sa.MetaData(), sa.Column("ref", sa.String(8), primary_key=True))
    refs.create(store.engine)
    with store.engine.begin() as conn:
        conn.execute(refs.insert().values(ref="seen"))
    yield store, box, refs
    refs.drop(store.engine)
    box.drop_schema()
    store.drop_schema()
    store.close()


def outbox_rows(box: idemq.Outbox) -> int:
    with box.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {box.table}")).scalar_one())


def swallow(conn: Any, refs: sa.Table) -> None:
    try:  # noqa: SIM105 -- the idiom as users write it, without a savepoint
        conn.execute(refs.insert().values(ref="seen"))
    except IntegrityError:
        pass


def test_add_into_an_aborted_transaction_is_a_lost_transaction(setup):
    store, box, refs = setup
    with store.engine.connect() as conn:
        with conn.begin():
            box.add(conn, "first-statement", b"ok")  # nothing sent before it: not aborted
        with conn.begin():
            swallow(conn, refs)
            with pytest.raises(idemq.TransactionLostError):
                box.add(conn, "orders", b"lost")
    assert outbox_rows(box) == 1


def test_a_guarded_handler_adding_after_a_swallowed_error_commits_nothing(setup):
    store, box, refs = setup
    guard = idemq.Idempotency(store, consumer="orders")
    adds: list[str] = []

    def handle(tx: sa.Connection) -> None:
        swallow(tx, refs)
        adds.append(box.add(tx, "orders", b"x"))

    with pytest.raises(idemq.TransactionLostError):
        guard.process("M1", handle)
    assert adds == []
    assert outbox_rows(box) == 0
    assert store.get("M1", "orders") is None


@pytest.fixture
async def async_setup(pg_url: str) -> AsyncIterator[tuple[Any, idemq.AsyncOutbox]]:
    store = idemq.AsyncSqlStore(pg_url, table=unique("mi"))
    await store.create_schema()
    box = idemq.AsyncOutbox(store, table=unique("ob"))
    await box.create_schema()
    yield store, box
    async with store.engine.begin() as conn:
        for name in (box.table, f"{box.table}_dead"):
            await conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
    await store.drop_schema()
    await store.close()


async def test_async_add_into_an_aborted_transaction_is_a_lost_transaction(async_setup):
    store, box = async_setup
    async with store.engine.connect() as conn:
        async with conn.begin():
            await box.add(conn, "first-statement", b"ok")
        async with conn.begin():
            with pytest.raises(sa.exc.ProgrammingError):
                await conn.execute(sa.text("SELECT * FROM idemq_no_such_table_here"))
            with pytest.raises(idemq.TransactionLostError):
                await box.add(conn, "orders", b"lost")
    async with store.engine.connect() as conn:
        count = (await conn.execute(sa.text(f"SELECT COUNT(*) FROM {box.table}"))).scalar_one()
    assert count == 1
