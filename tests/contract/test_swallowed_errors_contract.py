"""Transactional mode and a handler that catches a database error: PROCESSED only when the dedup
row is in what commits.

Handlers are written the way users write them: ``try: INSERT … except IntegrityError: pass``.
PostgreSQL aborts the whole transaction at the failed statement, and psycopg's COMMIT of an
aborted transaction returns normally (the server rolls back): without a check, the message was
answered PROCESSED and acknowledged while its effect and dedup row were both gone. SQLite and
MariaDB/MySQL only undo the failed statement, so there the handler may go on. A handler that
wants to go on everywhere uses its own savepoint, ``tx.begin_nested()``.

Every test asserts on the business table and on the dedup row, not only on the outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

import idemq
from tests.conftest import unique
from tests.contract.test_async_contract import dispose as dispose_async
from tests.contract.test_async_contract import make_async_store

Handler = Callable[[sa.Connection], Any]


@pytest.fixture
def tables(sql_store: idemq.SqlStore) -> Iterator[tuple[sa.Table, sa.Table]]:
    """A ledger (the effect) and a table of seen references with a unique key, holding ``ref-1``
    (what the swallowed INSERT collides with)."""
    metadata = sa.MetaData()
    ledger = sa.Table(
        unique("ledger"),
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(128)),
    )
    refs = sa.Table(unique("refs"), metadata, sa.Column("ref", sa.String(32), primary_key=True))
    metadata.create_all(sql_store.engine)
    with sql_store.engine.begin() as conn:
        conn.execute(refs.insert().values(ref="ref-1"))
    yield ledger, refs
    metadata.drop_all(sql_store.engine)


def effects(store: idemq.SqlStore, ledger: sa.Table) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(ledger.c.message_id).order_by(ledger.c.id)).scalars())


def swallowing(ledger: sa.Table, refs: sa.Table, message_id: str, result: Any = None) -> Handler:
    """The idiom: remember a reference unless it was seen, ignoring the duplicate-key error —
    without a savepoint of its own."""

    def handle(tx: sa.Connection) -> Any:
        tx.execute(ledger.insert().values(message_id=message_id))
        try:  # noqa: SIM105 -- written as users write it
            tx.execute(refs.insert().values(ref="ref-1"))
        except IntegrityError:
            pass  # "already seen, fine"
        return result

    return handle


def in_savepoint(ledger: sa.Table, refs: sa.Table, message_id: str) -> Handler:
    """The same, done right: the failing statement in a savepoint of the handler's own."""

    def handle(tx: sa.Connection) -> Any:
        tx.execute(ledger.insert().values(message_id=message_id))
        try:
            with tx.begin_nested():
                tx.execute(refs.insert().values(ref="ref-1"))
        except IntegrityError:
            pass
        return {"paid": message_id}

    return handle


def aborts_on_error(store: idemq.SqlStore) -> bool:
    """PostgreSQL aborts a transaction at its first failed statement; the others go on."""
    return store.engine.dialect.name == "postgresql"


@pytest.mark.parametrize("result", [None, {"paid": 1}], ids=["none", "result"])
def test_a_swallowed_error_is_processed_only_if_its_row_commits(sql_store, tables, result):
    ledger, refs = tables
    guard = idemq.Idempotency(sql_store, consumer="orders")
    try:
        outcome = guard.process("M1", swallowing(ledger, refs, "M1", result))
    except idemq.TransactionLostError:
        outcome = None

    if aborts_on_error(sql_store):
        # The transaction was aborted: no ack, nothing committed, the message runs again.
        assert outcome is None
        assert effects(sql_store, ledger) == []
        assert sql_store.get("M1", "orders") is None
    else:
        # Only the failed statement was undone: the handler's effect commits with its row.
        assert outcome is not None
        assert outcome.status is idemq.Status.PROCESSED
        assert effects(sql_store, ledger) == ["M1"]
        assert sql_store.get("M1", "orders") is not None

    # The redelivery, with the handler fixed: the effect lands exactly once in total.
    again = guard.process("M1", in_savepoint(ledger, refs, "M1"))
    assert again.should_ack
    assert effects(sql_store, ledger) == ["M1"]
    assert sql_store.get("M1", "orders").status is idemq.RecordStatus.PROCESSED


def test_a_lost_transaction_is_a_store_conflict_that_a_worker_counts(sql_store, tables):
    # TransactionLostError is a StoreConflictError: idemq reruns a transaction it owns (the
    # handler ran CLAIM_ATTEMPTS times here, each rolled back), then the message is retried.
    if not aborts_on_error(sql_store):
        pytest.skip("only PostgreSQL aborts a transaction at a swallowed error")
    ledger, refs = tables
    guard = idemq.Idempotency(sql_store, consumer="orders")
    runs: list[int] = []
    handler = swallowing(ledger, refs, "M1")

    def counted(tx: sa.Connection) -> Any:
        runs.append(1)
        return handler(tx)

    with pytest.raises(idemq.StoreConflictError) as raised:
        guard.process("M1", counted)
    assert isinstance(raised.value, idemq.TransactionLostError)
    assert "begin_nested" in str(raised.value)
    assert len(runs) == idemq.guard.core.CLAIM_ATTEMPTS
    assert effects(sql_store, ledger) == []
    assert sql_store.get("M1", "orders") is None


def test_a_handler_using_its_own_savepoint_is_processed_once(sql_store, tables):
    ledger, refs = tables
    guard = idemq.Idempotency(sql_store, consumer="orders")
    first = guard.process("M1", in_savepoint(ledger, refs, "M1"))
    again = guard.process("M1", in_savepoint(ledger, refs, "M1"))
    assert first.status is idemq.Status.PROCESSED
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == {"paid": "M1"}
    assert effects(sql_store, ledger) == ["M1"]


def test_inside_the_callers_transaction_a_lost_one_goes_to_the_caller(sql_store, tables):
    if not aborts_on_error(sql_store):
        pytest.skip("only PostgreSQL aborts a transaction at a swallowed error")
    ledger, refs = tables
    guard = idemq.Idempotency(sql_store, consumer="orders")
    with sql_store.engine.connect() as conn, conn.begin():
        conn.execute(ledger.insert().values(message_id="caller's own"))
        with pytest.raises(idemq.TransactionLostError):
            guard.process("M1", swallowing(ledger, refs, "M1"), connection=conn)
        # The guard's savepoint was rolled back: the caller's transaction is usable again.
        conn.execute(ledger.insert().values(message_id="after"))
    assert effects(sql_store, ledger) == ["caller's own", "after"]
    assert sql_store.get("M1", "orders") is None


def batch_handler(ledger: sa.Table, refs: sa.Table, swallower: str) -> Any:
    def handle(msg: idemq.Message, tx: sa.Connection) -> Any:
        if msg.id == swallower:
            return swallowing(ledger, refs, msg.id)(tx)
        tx.execute(ledger.insert().values(message_id=msg.id))
        return None

    return handle


@pytest.mark.parametrize("order", [["A", "B"], ["A", "B", "C"]], ids=["last", "middle"])
def test_a_batch_fails_only_the_message_whose_handler_lost_the_transaction(
    sql_store, tables, order
):
    ledger, refs = tables
    guard = idemq.Idempotency(sql_store, consumer="orders")
    messages = [idemq.Message(id=m, body=m.encode()) for m in order]
    outcomes = guard.process_batch(messages, batch_handler(ledger, refs, swallower="B"))
    by_id = {o.message_id: o for o in outcomes}
    others = [m for m in order if m != "B"]
    assert all(by_id[m].status is idemq.Status.PROCESSED for m in others)
    if aborts_on_error(sql_store):
        assert by_id["B"].status is idemq.Status.FAILED
        assert isinstance(by_id["B"].error, idemq.TransactionLostError)
        assert not by_id["B"].should_ack
        assert sorted(effects(sql_store, ledger)) == others
        assert sql_store.get("B", "orders") is None
    else:
        assert by_id["B"].status is idemq.Status.PROCESSED
        assert sorted(effects(sql_store, ledger)) == order
    for m in order:
        if by_id[m].status is idemq.Status.PROCESSED:
            assert sql_store.get(m, "orders") is not None


@pytest.fixture(params=["sqlite", "postgres", "mariadb"])
async def async_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    store = await make_async_store(request.param, tmp_path)
    yield store
    await dispose_async(store)


async def test_async_a_swallowed_error_is_processed_only_if_its_row_commits(async_store):
    metadata = sa.MetaData()
    ledger = sa.Table(unique("ledger"), metadata, sa.Column("message_id", sa.String(128)))
    refs = sa.Table(unique("refs"), metadata, sa.Column("ref", sa.String(32), primary_key=True))
    async with async_store.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(refs.insert().values(ref="ref-1"))
    guard = idemq.AsyncIdempotency(async_store, consumer="orders")

    async def swallow(tx: Any) -> None:
        await tx.execute(ledger.insert().values(message_id="M1"))
        try:  # noqa: SIM105 -- written as users write it
            await tx.execute(refs.insert().values(ref="ref-1"))
        except IntegrityError:
            pass

    try:
        try:
            outcome = await guard.process("M1", swallow)
        except idemq.TransactionLostError:
            outcome = None
        async with async_store.engine.connect() as conn:
            rows = (await conn.execute(sa.select(ledger.c.message_id))).scalars().all()
    finally:
        async with async_store.engine.begin() as conn:
            await conn.run_sync(metadata.drop_all)
    record = await async_store.get("M1", "orders")
    if async_store.engine.dialect.name == "postgresql":
        assert outcome is None
        assert rows == []
        assert record is None
    else:
        assert outcome is not None
        assert outcome.status is idemq.Status.PROCESSED
        assert rows == ["M1"]
        assert record is not None
