"""Transactional mode: the dedup row and the business change commit together or not at all.

Runs on SQLite, PostgreSQL, MariaDB and MySQL's portable plan (against MariaDB). Every test
asserts on the business table, not only on the returned outcome.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import idemq
from tests.conftest import unique


@pytest.fixture
def ledger(sql_store: idemq.SqlStore) -> Any:
    """A business table ``(message_id, amount)`` next to the dedup table."""
    table = sa.Table(
        unique("ledger"),
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(128)),
        sa.Column("amount", sa.Integer),
    )
    table.create(sql_store.engine)
    yield table
    table.drop(sql_store.engine)


def rows(store: idemq.SqlStore, table: sa.Table) -> list[tuple[Any, ...]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(table.c.message_id, table.c.amount))]


def pay(ledger: sa.Table, message_id: str, amount: int = 10) -> Any:
    def handler(tx: sa.Connection) -> dict[str, Any]:
        tx.execute(ledger.insert().values(message_id=message_id, amount=amount))
        return {"paid": amount}

    return handler


def test_effect_and_dedup_row_commit_together(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    assert guard.mode is idemq.Mode.TRANSACTIONAL

    first = guard.process("ORDER_1", pay(ledger, "ORDER_1"), business_id="order_1")
    second = guard.process("ORDER_1", pay(ledger, "ORDER_1", amount=999))

    assert first.status is idemq.Status.PROCESSED
    assert second.status is idemq.Status.DUPLICATE
    assert second.result == {"paid": 10}
    assert rows(sql_store, ledger) == [("ORDER_1", 10)]
    record = sql_store.get("ORDER_1", "orders")
    assert record.status is idemq.RecordStatus.PROCESSED
    assert record.business_id == "order_1"


def test_handler_error_rolls_back_effect_and_dedup_row(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")

    def write_then_fail(tx: sa.Connection) -> None:
        tx.execute(ledger.insert().values(message_id="M", amount=10))
        raise RuntimeError("crash after the business write")

    with pytest.raises(RuntimeError, match="after the business write"):
        guard.process("M", write_then_fail)

    assert rows(sql_store, ledger) == []
    assert sql_store.get("M", "orders") is None
    assert guard.process("M", pay(ledger, "M")).status is idemq.Status.PROCESSED
    assert rows(sql_store, ledger) == [("M", 10)]


def test_statements_on_the_driver_connection_under_tx_share_its_transaction(sql_store, ledger):
    """A handler's statements on the DBAPI cursor under ``tx`` (what bench/e2e.py's
    ``handle_driver`` does) write inside the dedup transaction — committed with the dedup row,
    rolled back with it."""
    guard = idemq.Idempotency(sql_store, consumer="orders")
    name = sql_store.engine.dialect.identifier_preparer.format_table(ledger)
    marker = "?" if sql_store.engine.dialect.paramstyle == "qmark" else "%s"
    insert = f"INSERT INTO {name} (message_id, amount) VALUES ({marker}, {marker})"

    def pay_on_driver(message_id: str, *, fail: bool = False) -> Any:
        def handler(tx: sa.Connection) -> None:
            cursor = tx.connection.driver_connection.cursor()
            cursor.execute(insert, (message_id, 10))
            if fail:
                raise RuntimeError("crash after the business write")

        return handler

    with pytest.raises(RuntimeError, match="after the business write"):
        guard.process("D1", pay_on_driver("D1", fail=True))
    assert rows(sql_store, ledger) == []
    assert sql_store.get("D1", "orders") is None

    assert guard.process("D1", pay_on_driver("D1")).status is idemq.Status.PROCESSED
    assert guard.process("D1", pay_on_driver("D1")).status is idemq.Status.DUPLICATE
    assert rows(sql_store, ledger) == [("D1", 10)]


def test_none_result_is_replayed_as_none(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    guard.process("M", lambda tx: None)
    replay = guard.process("M", lambda tx: "other")
    assert replay.status is idemq.Status.DUPLICATE
    assert replay.result is None


def test_payload_mismatch_rolls_back(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    guard.process("M", pay(ledger, "M"), payload=b"amount=10")
    with pytest.raises(idemq.PayloadMismatchError):
        guard.process("M", pay(ledger, "M"), payload=b"amount=11")
    assert rows(sql_store, ledger) == [("M", 10)]


def test_joins_the_callers_open_transaction(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    with sql_store.engine.connect() as conn:
        conn.begin()
        conn.execute(ledger.insert().values(message_id="outer", amount=1))
        guard.process("M", pay(ledger, "M"), connection=conn)
        conn.rollback()  # the caller decides: everything goes, dedup row included
    assert rows(sql_store, ledger) == []
    assert sql_store.get("M", "orders") is None

    with sql_store.engine.connect() as conn:
        conn.begin()
        guard.process("M", pay(ledger, "M"), connection=conn)
        conn.commit()
    assert rows(sql_store, ledger) == [("M", 10)]
    assert guard.process("M", pay(ledger, "M")).status is idemq.Status.DUPLICATE


def test_handler_error_inside_callers_transaction_keeps_the_callers_work(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    with sql_store.engine.connect() as conn:
        conn.begin()
        conn.execute(ledger.insert().values(message_id="outer", amount=1))
        with pytest.raises(RuntimeError):
            guard.process("M", lambda tx: (_ for _ in ()).throw(RuntimeError("x")), connection=conn)
        conn.commit()
    assert rows(sql_store, ledger) == [("outer", 1)]
    assert sql_store.get("M", "orders") is None


def test_joins_an_orm_session(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    with Session(sql_store.engine) as session:
        outcome = guard.process("M", pay(ledger, "M"), connection=session)
        session.commit()
    assert outcome.status is idemq.Status.PROCESSED
    assert rows(sql_store, ledger) == [("M", 10)]


def test_batch_uses_a_savepoint_per_message(sql_store, ledger):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    guard.process("seen", pay(ledger, "seen"))

    def handle(msg: idemq.Message, tx: sa.Connection) -> int:
        tx.execute(ledger.insert().values(message_id=msg.id, amount=int(msg.body)))
        if msg.id == "bad":
            raise ValueError("poison after a write")
        return int(msg.body)

    messages = [
        idemq.Message(id=i, body=b)
        for i, b in [("a", b"1"), ("bad", b"2"), ("seen", b"3"), ("b", b"4"), ("a", b"1")]
    ]
    outcomes = guard.process_batch(messages, handle)

    assert [o.status.value for o in outcomes] == [
        "processed",
        "failed",
        "duplicate",
        "processed",
        "duplicate",
    ]
    assert sorted(rows(sql_store, ledger)) == [("a", 1), ("b", 4), ("seen", 10)]
    assert sql_store.get("bad", "orders") is None
    retried = guard.process_batch([idemq.Message(id="bad", body=b"5")], lambda m, tx: "ok")
    assert retried[0].status is idemq.Status.PROCESSED


def test_redis_like_stores_refuse_transactional_mode():
    with pytest.raises(idemq.ConfigurationError):
        idemq.Idempotency(idemq.MemoryStore(), mode="transactional")


def test_create_schema_is_idempotent_and_ddl_prints(sql_store):
    sql_store.create_schema()
    sql_store.create_schema()
    for dialect in ("postgresql", "mysql", "mariadb", "sqlite"):
        assert "message_idempotent" in idemq.stores.sql.schema_sql(dialect)


def test_a_result_with_a_lone_surrogate_commits_and_replays_exactly(sql_store):
    guard = idemq.Idempotency(sql_store, consumer="orders")
    result = {"note": "bad \udcff byte", "plain": "ü"}
    assert guard.process("M", lambda _tx: result).result == result
    assert guard.process("M", lambda _tx: "never").result == result


@pytest.mark.parametrize("result", [0, False, "", [], {}, 0.0], ids=repr)
def test_a_falsy_result_is_stored_in_the_dedup_transaction_and_replayed(sql_store, result):
    # A "falsy means nothing to store" shortcut would replay None to every duplicate.
    guard = idemq.Idempotency(sql_store, consumer="orders")
    assert guard.process("M", lambda _tx: result).result == result
    replayed = guard.process("M", lambda _tx: "never")
    assert replayed.status is idemq.Status.DUPLICATE
    assert replayed.result == result
    assert type(replayed.result) is type(result)
