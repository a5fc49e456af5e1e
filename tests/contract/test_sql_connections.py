"""What a SQL store's connections live through, on SQLAlchemy's pool.

A killed server session costs one StoreUnavailableError and nothing is written; the next message
reconnects. What a handler does to ``tx`` (closing it, setting execution options) does not leak
into the next message, and a failed statement does not break the connection for the next one.
``close()`` leaves no session open, and a ``NullPool`` none between messages. A forked child
never uses its parent's connection. SQLite transactions take the write lock at BEGIN. The
connection a store keeps between its transactions is one of the pool's, and goes back to it after
a pause, so the pool's pre-ping still applies.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import idemq
from idemq.drivers.sql import KEEP_IDLE_S
from tests.conftest import PG_URL, require_service, unique
from tests.contract.conftest import SESSION_ID, URL, kill


@pytest.fixture
def counted(server: str) -> Iterator[tuple[idemq.SqlStore, sa.Table]]:
    """A store and a business table of applied message ids."""
    store = idemq.SqlStore(URL[server], table=unique("mi"))
    store.create_schema()
    applied = sa.Table(unique("applied"), sa.MetaData(), sa.Column("message_id", sa.String(128)))
    applied.create(store.engine)
    yield store, applied
    applied.drop(store.engine)
    store.drop_schema()
    store.close()


def applied_ids(store: idemq.SqlStore, applied: sa.Table) -> list[str]:
    with store.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(sa.select(applied.c.message_id)))


def apply(applied: sa.Table, session_ids: list[Any], server: str) -> Any:
    def handler(tx: sa.Connection) -> None:
        session_ids.append(tx.exec_driver_sql(SESSION_ID[server]).scalar())
        tx.execute(applied.insert().values(message_id=f"m{len(session_ids)}"))

    return handler


def test_a_killed_session_fails_one_message_and_the_next_reconnects(counted, server):
    store, applied = counted
    guard = idemq.Idempotency(store, consumer="c")
    sessions: list[Any] = []
    # Two transactions at once: both connections stay in the pool afterwards.
    with store.transaction() as a, store.transaction() as b:
        for conn in (a, b):
            sessions.append(conn.exec_driver_sql(SESSION_ID[server]).scalar())
    for session_id in sessions:
        kill(server, session_id)

    seen: list[Any] = []
    with pytest.raises(idemq.StoreUnavailableError):
        guard.process("M1", apply(applied, seen, server))
    # On a disconnect the pool invalidates its other (dead) connection too: the retry reconnects.
    outcome = guard.process("M1", apply(applied, seen, server))

    assert outcome.status is idemq.Status.PROCESSED
    assert len(seen) == 1, "the handler ran once: not on the failed attempt"
    assert seen[0] not in sessions
    assert applied_ids(store, applied) == ["m1"]
    assert guard.process("M1", apply(applied, seen, server)).status is idemq.Status.DUPLICATE


def test_execution_options_set_by_a_handler_do_not_reach_the_next_message(counted):
    store, _applied = counted
    guard = idemq.Idempotency(store, consumer="c")
    options: list[dict[str, Any]] = []

    def reconfigure(tx: sa.Connection) -> None:
        tx.execution_options(logging_token="handler-1")

    def look(tx: sa.Connection) -> None:
        options.append(dict(tx.get_execution_options()))

    guard.process("M1", reconfigure)
    guard.process("M2", look)
    assert "logging_token" not in options[0]


def test_a_handler_that_closes_tx_does_not_break_the_next_message(counted, server):
    store, applied = counted
    guard = idemq.Idempotency(store, consumer="c")
    with pytest.raises(idemq.IdemqError):
        guard.process("M1", lambda tx: tx.close())
    seen: list[Any] = []
    assert guard.process("M2", apply(applied, seen, server)).status is idemq.Status.PROCESSED
    assert applied_ids(store, applied) == ["m1"]
    assert store.get("M1", "c") is None, "the closed transaction committed nothing"


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "mariadb"])
def test_a_failed_statement_does_not_break_the_next_message(backend: str, tmp_path: Any) -> None:
    if backend != "sqlite":
        require_service("postgres" if backend == "postgres" else "mysql")
    url = f"sqlite:///{tmp_path / 'failed.db'}" if backend == "sqlite" else URL[backend]
    store = idemq.SqlStore(url, table=unique("mi"))
    guard = idemq.Idempotency(store, consumer="c")
    try:
        with pytest.raises(idemq.StoreError):  # the table does not exist yet
            guard.process("M1", lambda _tx: None)
        store.create_schema()
        assert guard.process("M1", lambda _tx: 1).status is idemq.Status.PROCESSED
        assert guard.process("M1", lambda _tx: 2).result == 1
    finally:
        store.drop_schema()
        store.close()


def sessions_named(name: str) -> int:
    """PostgreSQL sessions open under ``application_name``."""
    admin = sa.create_engine(PG_URL, poolclass=NullPool)
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(n)s"
    with admin.connect() as conn:
        count = int(conn.exec_driver_sql(sql, {"n": name}).scalar() or 0)
    admin.dispose()
    return count


@pytest.mark.parametrize("pool", ["queue", "null"])
def test_close_leaves_no_session_open_and_a_null_pool_none_between_messages(pool):
    require_service("postgres")
    name = unique("app")
    kwargs: dict[str, Any] = {"connect_args": {"application_name": name}}
    if pool == "null":
        kwargs["poolclass"] = NullPool
    store = idemq.SqlStore(PG_URL, table=unique("mi"), **kwargs)
    store.create_schema()
    try:
        guard = idemq.Idempotency(store, consumer="c")
        for i in range(3):
            guard.process(f"M{i}", lambda tx: None)
        assert sessions_named(name) == (1 if pool == "queue" else 0)
    finally:
        store.drop_schema()
        store.close()
    assert sessions_named(name) == 0, "close() closes the pooled connection"


def pg_session(tx: sa.Connection) -> Any:
    return tx.exec_driver_sql(SESSION_ID["postgres"]).scalar()


def _forked_child(guard: idemq.Idempotency, queue: Any) -> None:
    queue.put(guard.process("CHILD", pg_session).result)


def test_a_forked_child_never_uses_the_parents_connection():
    require_service("postgres")
    store = idemq.SqlStore(PG_URL, table=unique("mi"))
    store.create_schema()
    try:
        guard = idemq.Idempotency(store, consumer="c")
        parent = guard.process("PARENT", pg_session).result
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_forked_child, args=(guard, queue))
        child.start()
        child_session = queue.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert child_session != parent
        # The parent's pooled connection still works after the child exited.
        assert guard.process("PARENT2", pg_session).result == parent
        assert store.get("CHILD", "c") is not None
    finally:
        store.drop_schema()
        store.close()


def test_sqlite_transactions_take_the_write_lock_at_begin(tmp_path):
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    store.create_schema()
    try:
        for open_tx in (store.transaction, store.engine.begin):
            with open_tx() as conn:
                conn.exec_driver_sql("SELECT 1")  # a read: lazy pysqlite would not BEGIN
                other = store.engine.raw_connection()
                try:
                    other.execute("PRAGMA busy_timeout = 0")
                    with pytest.raises(Exception, match="locked"):
                        other.execute("BEGIN IMMEDIATE")
                finally:
                    other.close()
    finally:
        store.drop_schema()
        store.close()


# -- the connection a store keeps between its transactions (drivers.sql.Transactions) ----------
# The tests above hold for it too: options a handler set, a closed tx, a killed session, a
# NullPool and a forked child each send it back to the pool or past it. These cover the rest.


def make_store(server: str, **engine_kwargs: Any) -> idemq.SqlStore:
    store = idemq.SqlStore(URL[server], table=unique("kept"), **engine_kwargs)
    store.create_schema()
    return store


def session_of(store: idemq.SqlStore, server: str) -> Any:
    with store.transaction() as tx:
        return tx.exec_driver_sql(SESSION_ID[server]).scalar_one()


def test_messages_one_after_another_check_out_one_connection(server: str) -> None:
    store = make_store(server)
    checkouts = [0]

    @sa.event.listens_for(store.engine, "checkout")
    def _checkout(*_args: Any) -> None:
        checkouts[0] += 1

    try:
        guard = idemq.Idempotency(store, consumer="c")
        sessions = {session_of(store, server) for _ in range(20)}
        for i in range(20):
            assert guard.process(f"M{i}", lambda _tx: None).status is idemq.Status.PROCESSED
        assert checkouts == [1], "the connection of the last transaction serves the next"
        assert len(sessions) == 1
    finally:
        store.drop_schema()
        store.close()


def test_a_kept_connection_idle_too_long_goes_back_to_the_pool_and_its_pre_ping(
    server: str,
) -> None:
    """A consumer that paused meets the pool's ``pool_pre_ping`` as before: the session it
    kept was killed while it sat unused, and the next message runs on a fresh one."""
    store = make_store(server, pool_pre_ping=True)
    try:
        before = session_of(store, server)
        kill(server, before)
        time.sleep(KEEP_IDLE_S + 0.3)
        guard = idemq.Idempotency(store, consumer="c")
        assert guard.process("M1", lambda _tx: None).status is idemq.Status.PROCESSED
        assert session_of(store, server) != before
    finally:
        store.drop_schema()
        store.close()


def test_threads_sharing_a_store_stay_within_the_pool(server: str) -> None:
    """Eight threads on a pool of two: the kept connection is one of the pool's, so threads
    that find it taken wait for the pool as before, and every message is paid once."""
    store = make_store(server, pool_size=2, max_overflow=0, pool_timeout=30)
    opened = [0]

    @sa.event.listens_for(store.engine, "connect")
    def _connect(*_args: Any) -> None:
        opened[0] += 1

    paid: list[str] = []
    lock = threading.Lock()

    def work() -> None:
        guard = idemq.Idempotency(store, consumer="c")
        for i in range(30):
            message_id = f"M{i % 10}"  # every thread races for the same ten messages

            def handler(_tx: sa.Connection, message_id: str = message_id) -> None:
                with lock:
                    paid.append(message_id)

            guard.process(message_id, handler)

    try:
        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert sorted(paid) == [f"M{i}" for i in range(10)]
        assert opened[0] <= 2
    finally:
        store.drop_schema()
        store.close()


def test_a_commit_the_server_refused_leaves_the_next_message_a_working_one() -> None:
    """PostgreSQL checks a deferred constraint at COMMIT: the refused COMMIT raises, and the
    connection it leaves behind must not carry that transaction into the next message."""
    require_service("postgres")
    store = make_store("postgres")
    table = unique("deferred")
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {table} (id INT, CONSTRAINT {table}_u UNIQUE (id) "
            "DEFERRABLE INITIALLY DEFERRED)"
        )
    guard = idemq.Idempotency(store, consumer="c")

    def insert_twice(tx: sa.Connection) -> None:
        tx.exec_driver_sql(f"INSERT INTO {table} VALUES (1), (1)")

    try:
        with pytest.raises(idemq.StoreError):
            guard.process("M1", insert_twice)
        assert guard.process("M1", lambda _tx: None).status is idemq.Status.PROCESSED
        assert guard.process("M2", lambda _tx: None).status is idemq.Status.PROCESSED
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        store.drop_schema()
        store.close()
