"""What a SQL store's connections live through, on SQLAlchemy's pool.

A killed server session costs one StoreUnavailableError and nothing is written; the next message
reconnects. What a handler does to ``tx`` (closing it, setting execution options) does not leak
into the next message, and a failed statement does not break the connection for the next one.
``close()`` leaves no session open, and a ``NullPool`` none between messages. A forked child
never uses its parent's connection. SQLite transactions take the write lock at BEGIN.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import idemq
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

SESSION_ID = {"postgres": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}
KILL = {"postgres": "SELECT pg_terminate_backend({})", "mariadb": "KILL {}"}
URL = {"postgres": PG_URL, "mariadb": MYSQL_URL}


@pytest.fixture(params=["postgres", "mariadb"])
def server(request: pytest.FixtureRequest) -> str:
    require_service("postgres" if request.param == "postgres" else "mysql")
    return str(request.param)


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


def kill(server: str, session_id: Any) -> None:
    admin = sa.create_engine(URL[server], poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(KILL[server].format(int(session_id)))
    admin.dispose()


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
