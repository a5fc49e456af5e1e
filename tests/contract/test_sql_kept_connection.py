"""A store keeps the connection of its last transaction for the next one, and gives it back to
the pool whenever the pool's own rules must apply (``idemq.drivers.sql.Transactions``).

Each test breaks one of the conditions under which a kept connection is used again: options a
handler set on it, a session killed while it sat unused, a pool that keeps nothing, a forked
child, many threads on one store.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

import idemq
from idemq.drivers import sql as driver_sql
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

URL = {"postgres": PG_URL, "mariadb": MYSQL_URL}
SESSION_ID = {"postgres": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}
KILL = {"postgres": "SELECT pg_terminate_backend({})", "mariadb": "KILL {}"}


@pytest.fixture(params=["postgres", "mariadb"])
def server(request: pytest.FixtureRequest) -> str:
    require_service("postgres" if request.param == "postgres" else "mysql")
    return str(request.param)


def make_store(server: str, **engine_kwargs: Any) -> idemq.SqlStore:
    store = idemq.SqlStore(URL[server], table=unique("kept"), **engine_kwargs)
    store.create_schema()
    return store


@pytest.fixture
def store(server: str) -> Iterator[idemq.SqlStore]:
    store = make_store(server)
    yield store
    store.drop_schema()
    store.close()


def count_checkouts(engine: sa.Engine) -> list[int]:
    checkouts = [0]

    @event.listens_for(engine, "checkout")
    def _checkout(*_args: Any) -> None:
        checkouts[0] += 1

    return checkouts


def session_of(store: idemq.SqlStore, server: str) -> int:
    with store.transaction() as tx:
        return int(tx.exec_driver_sql(SESSION_ID[server]).scalar_one())


def kill(server: str, session: int) -> None:
    admin = sa.create_engine(URL[server], poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(KILL[server].format(session))
    admin.dispose()


def pay(store: idemq.SqlStore, message_id: str) -> idemq.Outcome[Any]:
    guard = idemq.Idempotency(store, consumer="c")
    return guard.process(message_id, lambda tx: tx.exec_driver_sql("SELECT 1").scalar())


def test_messages_one_after_another_check_out_one_connection(
    store: idemq.SqlStore, server: str
) -> None:
    checkouts = count_checkouts(store.engine)
    sessions = {session_of(store, server) for _ in range(20)}
    for i in range(20):
        assert pay(store, f"M{i}").status is idemq.Status.PROCESSED
    assert checkouts == [1], "the connection of the last transaction serves the next"
    assert len(sessions) == 1


def test_options_a_handler_set_on_its_connection_end_with_its_transaction(
    store: idemq.SqlStore,
) -> None:
    """``Connection.execution_options()`` changes the connection in place: a handler's options
    (a schema map, a logging token) must not reach the next message's handler, as they would
    not on a ``Connection`` fresh from the pool."""
    seen: list[dict[str, Any]] = []

    def with_options(tx: sa.Connection) -> None:
        tx.execution_options(logging_token="handler-1", schema_translate_map={None: "other"})
        seen.append(dict(tx.get_execution_options()))

    guard = idemq.Idempotency(store, consumer="c")
    assert guard.process("M1", with_options).status is idemq.Status.PROCESSED
    guard.process("M2", lambda tx: seen.append(dict(tx.get_execution_options())))
    assert seen[0]["logging_token"] == "handler-1"
    assert "logging_token" not in seen[1]
    assert "schema_translate_map" not in seen[1]


def test_a_kept_connection_idle_too_long_goes_back_to_the_pool_and_its_pre_ping(
    server: str,
) -> None:
    """A consumer that paused meets the pool's ``pool_pre_ping`` as before: the session it
    kept was killed while it sat unused, and the next message runs on a fresh one."""
    store = make_store(server, pool_pre_ping=True)
    try:
        before = session_of(store, server)
        kill(server, before)
        time.sleep(driver_sql.KEEP_IDLE_S + 0.3)
        assert pay(store, "M1").status is idemq.Status.PROCESSED
        assert session_of(store, server) != before
    finally:
        store.drop_schema()
        store.close()


def test_a_session_killed_while_kept_costs_one_attempt_and_is_replaced(
    store: idemq.SqlStore, server: str
) -> None:
    before = session_of(store, server)
    kill(server, before)
    with pytest.raises(idemq.StoreUnavailableError):
        pay(store, "M1")
    assert pay(store, "M1").status is idemq.Status.PROCESSED
    assert session_of(store, server) != before


def test_an_engine_without_a_pool_keeps_no_connection(server: str) -> None:
    engine = sa.create_engine(URL[server], poolclass=sa.pool.NullPool)
    store = idemq.SqlStore(engine, table=unique("kept"))
    store.create_schema()
    try:
        connects = [0]

        @event.listens_for(engine, "connect")
        def _connect(*_args: Any) -> None:
            connects[0] += 1

        for i in range(5):
            assert pay(store, f"M{i}").status is idemq.Status.PROCESSED
        assert connects == [5], "NullPool: every transaction connects and closes"
    finally:
        store.drop_schema()
        store.close()
        engine.dispose()


def _pay_in_child(store: idemq.SqlStore, server: str, answers: Any) -> None:
    try:
        outcome = pay(store, "CHILD")
        answers.put((outcome.status.name, session_of(store, server)))
    except BaseException as error:  # the parent asserts on what came back
        answers.put((repr(error), -1))


def test_a_forked_child_never_uses_the_connection_its_parent_kept(
    store: idemq.SqlStore, server: str
) -> None:
    parent = session_of(store, server)
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=_pay_in_child, args=(store, server, answers))
    child.start()
    status, child_session = answers.get(timeout=30)
    child.join(timeout=30)
    assert status == "PROCESSED"
    assert child_session != parent
    # The parent's session is untouched by the child (its socket was never used there).
    assert session_of(store, server) == parent
    assert pay(store, "PARENT").status is idemq.Status.PROCESSED


def test_threads_sharing_a_store_stay_within_the_pool(server: str) -> None:
    """Eight threads on a pool of two: the kept connection is one of the pool's, so threads
    that find it taken wait for the pool as before, and every message is paid once."""
    store = make_store(server, pool_size=2, max_overflow=0, pool_timeout=30)
    opened = [0]

    @event.listens_for(store.engine, "connect")
    def _connect(*_args: Any) -> None:
        opened[0] += 1

    paid: list[str] = []
    lock = threading.Lock()

    def work(worker: int) -> None:
        guard = idemq.Idempotency(store, consumer="c")
        for i in range(30):
            message_id = f"M{i % 10}"  # every thread races for the same ten messages

            def handler(_tx: sa.Connection, message_id: str = message_id) -> None:
                with lock:
                    paid.append(message_id)

            guard.process(message_id, handler)

    try:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert sorted(paid) == [f"M{i}" for i in range(10)]
        assert opened[0] <= 2
    finally:
        store.drop_schema()
        store.close()


def test_a_handler_that_closed_its_connection_leaves_the_next_message_a_working_one(
    store: idemq.SqlStore,
) -> None:
    guard = idemq.Idempotency(store, consumer="c")
    with pytest.raises(idemq.StoreError):  # nothing was committed: the message runs again
        guard.process("M1", lambda tx: tx.close())
    assert pay(store, "M1").status is idemq.Status.PROCESSED


def test_a_commit_the_server_refused_leaves_the_next_message_a_working_one(
    server: str,
) -> None:
    """PostgreSQL checks a deferred constraint at COMMIT: the refused COMMIT raises, and the
    connection it leaves behind must not carry that transaction into the next message."""
    if server != "postgres":
        pytest.skip("deferred constraints are PostgreSQL's")
    store = make_store(server)
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
        assert guard.process("M1", lambda tx: None).status is idemq.Status.PROCESSED
        assert pay(store, "M2").status is idemq.Status.PROCESSED
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        store.drop_schema()
        store.close()
