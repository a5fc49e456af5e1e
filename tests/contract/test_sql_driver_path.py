"""What SQLAlchemy did around a statement still happens on the driver's cursor.

The statements run for every message go to the DBAPI cursor of the transaction's connection
(:class:`idemq.drivers.sql.DriverStatement`). There, as through ``Connection.execute``: a
driver's own error is translated into idemq's tree (a deadlock is a conflict, a lost session an
outage); a connection lost mid-statement is invalidated at once and the next message runs on a
fresh one; SQLite refuses a statement once it ended the transaction by itself.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pymysql
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

import idemq
from idemq.drivers.sql import translate_db_error
from idemq.guard.core import Policy
from idemq.stores.base import ClaimRequest
from tests.conftest import require_service, unique
from tests.contract.conftest import SESSION_ID, URL, kill


@pytest.fixture
def store(server: str) -> Iterator[idemq.SqlStore]:
    store = idemq.SqlStore(URL[server], table=unique("drv"))
    store.create_schema()
    yield store
    store.drop_schema()
    store.close()


def request_for(message_id: str) -> ClaimRequest:
    policy = Policy.build(consumer="c", mode="transactional", lease_s=30, clock=None)
    return policy.request(message_id, None)


def test_a_session_killed_mid_transaction_is_invalidated_and_the_next_message_reconnects(
    store: idemq.SqlStore, server: str
) -> None:
    invalidated: list[bool] = []
    killed: list[Any] = []

    def claim_on_a_killed_session() -> None:
        with store.transaction() as tx:
            killed.append(tx.exec_driver_sql(SESSION_ID[server]).scalar())
            kill(server, killed[0])
            try:
                store.claim_in(tx, request_for("M1"))
            finally:
                invalidated.append(tx.invalidated)

    with pytest.raises(idemq.StoreUnavailableError):
        claim_on_a_killed_session()
    assert invalidated == [True], "the lost connection is invalidated at the failed statement"

    sessions: list[Any] = []
    outcome = idemq.Idempotency(store, consumer="c").process(
        "M1", lambda tx: sessions.append(tx.exec_driver_sql(SESSION_ID[server]).scalar())
    )
    assert outcome.status is idemq.Status.PROCESSED
    assert sessions
    assert sessions[0] != killed[0]


def test_a_deadlock_between_two_claims_is_a_conflict(store: idemq.SqlStore) -> None:
    # Each transaction claims one id, then the other's: one of them waits for the other's row
    # lock while the other waits for its own, and the server rolls one back.
    both_claimed = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def cross(first: str, second: str) -> None:
        try:
            with store.transaction() as tx:
                store.claim_in(tx, request_for(first))
                both_claimed.wait()
                store.claim_in(tx, request_for(second))
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=cross, args=("A", "B")),
        threading.Thread(target=cross, args=("B", "A")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 1, errors
    assert isinstance(errors[0], idemq.StoreConflictError)
    assert type(errors[0].__cause__).__module__.split(".")[0] in ("psycopg", "pymysql")
    survivor = store.find("A") + store.find("B")
    assert len(survivor) == 2, "the other transaction committed both claims"


def test_sqlite_refuses_a_claim_once_sqlite_ended_the_transaction(tmp_path: Any) -> None:
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'ended.db'}", table=unique("drv"))
    store.create_schema()
    refs = sa.Table(
        unique("refs"), sa.MetaData(), sa.Column("ref", sa.String(32), primary_key=True)
    )
    refs.create(store.engine)
    with store.engine.begin() as conn:
        conn.execute(refs.insert().values(ref="ref-1"))
    try:

        def claim_after_sqlite_rolled_back() -> None:
            with store.transaction() as tx:
                try:  # noqa: SIM105 -- a handler that swallows the error
                    tx.exec_driver_sql(f"INSERT OR ROLLBACK INTO {refs.name} VALUES ('ref-1')")
                except IntegrityError:
                    pass
                store.claim_in(tx, request_for("M1"))

        with pytest.raises(idemq.TransactionLostError):
            claim_after_sqlite_rolled_back()
        assert store.get("M1", "c") is None, "no claim committed on its own"
    finally:
        refs.drop(store.engine)
        store.drop_schema()
        store.close()


def _raw_error(run: Any) -> BaseException:
    try:
        run()
    except Exception as error:
        return error
    raise AssertionError("the statement did not fail")


def test_a_drivers_own_errors_are_translated_like_sqlalchemys(tmp_path: Any) -> None:
    require_service("postgres")
    require_service("mysql")
    missing = unique("missing")
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test") as conn:
        no_table = _raw_error(lambda: conn.execute(f"SELECT 1 FROM {missing}"))
    mysql = pymysql.connect(host="127.0.0.1", user="root", database="test")
    try:
        mysql_no_table = _raw_error(lambda: mysql.cursor().execute(f"SELECT 1 FROM {missing}"))
    finally:
        mysql.close()
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=0)
    locked = _raw_error(lambda: waiter.execute("BEGIN IMMEDIATE"))
    holder.close()
    waiter.close()

    assert isinstance(translate_db_error(no_table, "read"), idemq.StoreConfigurationError)
    assert isinstance(translate_db_error(mysql_no_table, "read"), idemq.StoreConfigurationError)
    assert isinstance(translate_db_error(locked, "claim"), idemq.StoreConflictError)
    closed = _raw_error(lambda: mysql.cursor().execute("SELECT 1"))
    assert isinstance(translate_db_error(closed, "claim"), idemq.StoreUnavailableError)
    assert "password" not in str(translate_db_error(no_table, "read"))


def test_sqlite_begin_that_finds_the_write_lock_taken_is_a_conflict(tmp_path: Any) -> None:
    # BEGIN IMMEDIATE goes to the driver's cursor from SQLAlchemy's begin event, where
    # SQLAlchemy does not wrap its error: the store's Transactions.begin() translates
    # sqlite3's own.
    path = tmp_path / "busy.db"
    store = idemq.SqlStore(f"sqlite:///{path}", table=unique("drv"))
    store.create_schema()
    store.engine.dispose()

    @sa.event.listens_for(store.engine, "connect")
    def no_waiting(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout = 0")

    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(idemq.StoreConflictError) as raised:
            idemq.Idempotency(store, consumer="c").process("M1", lambda tx: None)
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
    finally:
        holder.rollback()
        holder.close()
        store.drop_schema()
        store.close()
