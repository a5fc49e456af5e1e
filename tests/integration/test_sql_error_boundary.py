"""Every SQL path reports a database failure as the idemq error it is, through one boundary
(``idemq.drivers.sql.translated``): an outage as StoreUnavailableError, a deadlock as
StoreConflictError, a taken key as DuplicateKeyError, never a driver's or SQLAlchemy's own
exception, and never a password."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import idemq
from idemq.brokers import open_broker
from idemq.drivers.sql import engine_from_url, translated
from idemq.errors import DuplicateKeyError, StoreIntegrityError
from idemq.ids.node_lease_backends import SqlLeaseBackend
from idemq.ids.timestamp_store import SqlTimestampStore
from idemq.outbox import outbox_stats
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique
from tests.integration.test_outbox_relay import receive


def _terminate(application_name: str) -> int:
    """End every PostgreSQL session of ``application_name`` (as a server restart or a network
    cut would, seen from the client); how many there were."""
    admin = sa.create_engine(PG_URL)
    try:
        with admin.begin() as conn:
            ended = conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": application_name},
            ).all()
        return len(ended)
    finally:
        admin.dispose()


@pytest.fixture
def pg_outbox() -> Iterator[tuple[idemq.Outbox, str]]:
    """An outbox on PostgreSQL whose store's sessions carry a name of their own."""
    require_service("postgres")
    name = unique("sqlhouse")
    store = idemq.SqlStore(PG_URL, connect_args={"application_name": name})
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box, name
    box.drop_schema()
    store.close()


def test_an_outbox_add_on_a_dropped_connection_is_an_outage_every_time(
    pg_outbox: tuple[idemq.Outbox, str],
) -> None:
    outbox, name = pg_outbox
    with outbox.engine.connect() as conn:
        conn.begin()
        outbox.add(conn, "orders", b"first")  # the transaction is under way
        assert _terminate(name) >= 1
        with pytest.raises(idemq.StoreUnavailableError):
            outbox.add(conn, "orders", b"second")
        # SQLAlchemy now refuses the invalidated connection with an error of its own, not a
        # driver's: it must still come out as the outage it is.
        with pytest.raises(idemq.StoreUnavailableError):
            outbox.add(conn, "orders", b"third")
    with outbox.engine.begin() as conn:  # a fresh connection: the pool dropped the dead ones
        outbox.add(conn, "orders", b"after")
    # Only what committed: the row of the dead transaction never did.
    assert outbox_stats(outbox).pending == 1


async def test_an_async_outbox_add_on_a_dropped_connection_is_an_outage_every_time() -> None:
    require_service("postgres")
    name = unique("sqlhouse")
    store = idemq.AsyncSqlStore(PG_URL, connect_args={"application_name": name})
    outbox = idemq.AsyncOutbox(store, table=unique("ob"))
    await outbox.create_schema()
    # The same table seen through the sync outbox: what committed, and the teardown.
    seen = idemq.Outbox(idemq.SqlStore(PG_URL), table=outbox.table)
    try:
        async with store.engine.connect() as conn:
            await conn.begin()
            await outbox.add(conn, "orders", b"first")
            assert _terminate(name) >= 1
            with pytest.raises(idemq.StoreUnavailableError):
                await outbox.add(conn, "orders", b"second")
            with pytest.raises(idemq.StoreUnavailableError):
                await outbox.add(conn, "orders", b"third")
        async with store.engine.begin() as conn:
            await outbox.add(conn, "orders", b"after")
        assert outbox_stats(seen).pending == 1
    finally:
        seen.drop_schema()
        seen.store.close()
        await store.close()


def test_a_relay_whose_connection_drops_reports_an_outage_then_publishes(
    pg_outbox: tuple[idemq.Outbox, str], tmp_path: Path
) -> None:
    outbox, name = pg_outbox
    broker_url = f"embedded:///{tmp_path / 'queue.db'}"
    relay = idemq.OutboxRelay(outbox, broker_url)
    consumer = open_broker(broker_url)
    try:
        with outbox.engine.begin() as conn:
            first = outbox.add(conn, "orders", b"1")
        relay.run_once()  # the relay now keeps a connection of its own
        with outbox.engine.begin() as conn:
            second = outbox.add(conn, "orders", b"2")
        assert _terminate(name) >= 1
        with pytest.raises(idemq.StoreUnavailableError):
            relay.run_once()
        relay.run_once()  # on a fresh connection
        got = receive(consumer, "orders", 2, timeout_s=30)
    finally:
        relay.close()
        consumer.close()
    assert sorted(d.message.id for d in got if d.message) == sorted([first, second])
    assert outbox_stats(outbox).pending == 0


def test_a_node_lease_deadlock_on_mariadb_is_a_conflict_not_an_outage() -> None:
    """InnoDB's three-inserter deadlock: a transaction holds a new row, two lease takers insert
    the same key and wait; it rolls back, both hold a shared lock and want an exclusive one, and
    InnoDB rolls one back (1213). That one may try again; it must not be told the database is
    down."""
    require_service("mysql")
    engine = engine_from_url(MYSQL_URL, pool_size=4)
    table = unique("nl")
    backend = SqlLeaseBackend(engine, table)
    pool = unique("pool")
    results: list[object] = []

    def take(owner: str) -> None:
        try:
            results.append(backend.try_acquire(pool, ["N1"], owner, 60_000))
        except Exception as exc:  # the class is what the test looks at
            results.append(exc)

    try:
        with engine.connect() as holder:
            holder.begin()
            holder.execute(
                sa.insert(backend.table).values(
                    pool=pool, node="N1", owner="holder", lease_until_ms=0
                )
            )
            takers = [threading.Thread(target=take, args=(f"o{i}",)) for i in range(2)]
            for thread in takers:
                thread.start()
            _wait_for_lock_waiters(2, table)
            holder.rollback()
            for thread in takers:
                thread.join(timeout=30)
        conflicts = [r for r in results if isinstance(r, Exception)]
        assert results.count("N1") == 1, results
        assert len(conflicts) == 1, results
        assert isinstance(conflicts[0], idemq.StoreConflictError), repr(conflicts[0])
        assert "1213" in str(conflicts[0]) or "Deadlock" in str(conflicts[0])
        with engine.connect() as conn:
            owners = conn.execute(sa.select(backend.table.c.owner)).scalars().all()
        assert len(owners) == 1
        assert owners[0] in {"o0", "o1"}
    finally:
        backend.table.drop(engine, checkfirst=True)
        engine.dispose()


def _wait_for_lock_waiters(count: int, table: str, timeout_s: float = 20) -> None:
    """Until ``count`` sessions have been running their INSERT into ``table`` for 300 ms: with
    the holder's row there uncommitted, an INSERT that lasts is one waiting on its lock. (The
    server's process list, not InnoDB's lock views: those come from a cache that stays empty at
    times while other sessions create tables.)"""
    watcher = sa.create_engine(MYSQL_URL)
    query = sa.text(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
        "WHERE INFO LIKE :insert AND TIME_MS >= 300"
    )
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with watcher.connect() as conn:
                if conn.execute(query, {"insert": f"INSERT INTO {table} %"}).scalar_one() >= count:
                    return
            time.sleep(0.05)
        pytest.fail(f"{count} lease takers never waited on the row lock")
    finally:
        watcher.dispose()


def test_a_taken_key_is_told_apart_from_other_constraint_violations(sql_url: str) -> None:
    """The inserts that may race (a node lease, an id reservation, a derived outbox id) ride on
    this: each server's own duplicate-key error is a DuplicateKeyError, another constraint's
    only a StoreIntegrityError."""
    engine = engine_from_url(sql_url)
    table = sa.Table(
        unique("uk"),
        sa.MetaData(),
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("value", sa.Integer, nullable=False),
    )
    table.create(engine)
    try:
        with translated("first insert"), engine.begin() as conn:
            conn.execute(sa.insert(table).values(id="a", value=1))
        with (
            pytest.raises(DuplicateKeyError, match="insert the same key"),
            translated("insert the same key"),
            engine.begin() as conn,
        ):
            conn.execute(sa.insert(table).values(id="a", value=2))
        with (
            pytest.raises(StoreIntegrityError) as null,
            translated("insert a NULL"),
            engine.begin() as conn,
        ):
            conn.execute(sa.insert(table), {"id": "b", "value": None})
        assert not isinstance(null.value, DuplicateKeyError)
        with engine.connect() as conn:
            assert conn.execute(sa.select(table.c.value)).scalars().all() == [1]
    finally:
        table.drop(engine)
        engine.dispose()


def test_a_password_in_the_url_never_reaches_the_message() -> None:
    require_service("postgres")
    secret = "s3cret-sqlhouse-pw"
    url = f"postgresql+psycopg://postgres:{secret}@127.0.0.1:5432/no_such_db_{unique('d')}"
    store = idemq.SqlStore(url)
    try:
        with pytest.raises(idemq.StoreConfigurationError) as refused:
            store.create_schema()
    finally:
        store.close()
    assert "does not exist" in str(refused.value)
    assert secret not in str(refused.value)
    with pytest.raises(idemq.StoreUnavailableError) as down:  # nobody listens on port 1
        SqlTimestampStore(f"postgresql+psycopg://postgres:{secret}@127.0.0.1:1/test", "k")
    assert secret not in str(down.value)


def test_a_table_of_another_shape_is_a_setup_error_not_an_outage(sql_url: str) -> None:
    """A lease table of another shape (someone else's table by that name): every server says
    the column is unknown. The same statement fails the same way on every retry: a setup error
    (as a missing table is), never an outage a worker would wait on as if the server were down;
    the message names the step."""
    engine = engine_from_url(sql_url)
    table = unique("nl")
    other = sa.Table(
        table,
        sa.MetaData(),
        sa.Column("pool", sa.String(64), primary_key=True),
        sa.Column("node", sa.String(64), primary_key=True),
    )
    other.create(engine)
    try:
        backend = SqlLeaseBackend(engine, table)  # adopts the table it finds
        with pytest.raises(idemq.StoreConfigurationError, match="lease a node of pool"):
            backend.try_acquire(unique("pool"), ["N1"], "me", 60_000)
    finally:
        other.drop(engine)
        engine.dispose()


def test_a_statement_that_cannot_run_as_written_is_named_and_not_an_outage(
    sql_url: str,
) -> None:
    engine = engine_from_url(sql_url)
    try:
        with (
            pytest.raises(idemq.StoreError, match="a broken statement") as broken,
            translated("a broken statement"),
            engine.connect() as conn,
        ):
            conn.exec_driver_sql("SELEC 1")
        assert not isinstance(
            broken.value, idemq.StoreUnavailableError | idemq.StoreConfigurationError
        )
    finally:
        engine.dispose()


def test_a_business_transition_that_deadlocks_on_mariadb_is_a_conflict() -> None:
    """Two transactions move two orders in opposite order: InnoDB rolls one back (1213). The
    StateMachine's caller hears a StoreConflictError (run the message again), and the other
    transaction's transitions commit."""
    require_service("mysql")
    engine = engine_from_url(MYSQL_URL, pool_size=4)
    orders = sa.Table(
        unique("orders"),
        sa.MetaData(),
        sa.Column("order_id", sa.String(16), primary_key=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("fence_token", sa.BigInteger),
    )
    orders.create(engine)
    pay = {"pay": ("NEW", "PAID")}
    machine = idemq.StateMachine(orders.name, "order_id", "status", ["NEW", "PAID"], pay)
    with engine.begin() as conn:
        conn.execute(sa.insert(orders), [{"order_id": o, "status": "NEW"} for o in ("a", "b")])
    first_done = threading.Barrier(2, timeout=20)
    outcomes: dict[str, object] = {}

    def pay_both(name: str, first: str, second: str) -> None:
        try:
            with engine.begin() as conn:
                machine.apply(conn, first, "pay")
                first_done.wait()
                machine.apply(conn, second, "pay")
            outcomes[name] = "committed"
        except Exception as exc:  # the class is what the test looks at
            outcomes[name] = exc

    try:
        threads = [
            threading.Thread(target=pay_both, args=("ab", "a", "b")),
            threading.Thread(target=pay_both, args=("ba", "b", "a")),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        failed = [o for o in outcomes.values() if o != "committed"]
        assert len(failed) == 1, outcomes
        assert isinstance(failed[0], idemq.StoreConflictError), repr(failed[0])
        with engine.connect() as conn:
            statuses = conn.execute(sa.select(orders.c.status)).scalars().all()
        assert statuses == ["PAID", "PAID"]  # the winner's two transitions, nothing of the loser's
    finally:
        orders.drop(engine)
        engine.dispose()
