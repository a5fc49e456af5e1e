"""StateMachine on SQLite, PostgreSQL and MariaDB: outcomes, racing workers, fencing, async twin.

The race tests give every worker a *different* message id on purpose: the dedup table cannot
help, so only the conditional UPDATE on the business row stands between them and a double debit.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    Uuid,
    create_engine,
    event,
    select,
    update,
)
from sqlalchemy.orm import Session

from idemq.business.state_machine import StateMachine, TransitionResult
from idemq.business.versioned import versioned_update
from idemq.errors import ConfigurationError, StoreConflictError, StoreError
from tests.conftest import unique

R = TransitionResult
STATES = ["PENDING_PAYMENT", "PAYMENT_FAILED", "PAID", "SHIPPED"]
WORKERS = 8
CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def make_engine(url: str) -> Engine:
    """SQLite: BEGIN IMMEDIATE + busy timeout so racing writers queue instead of failing."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_size=WORKERS + 2)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


@dataclass
class Db:
    engine: Engine
    url: str
    orders: Table
    accounts: Table
    machine: StateMachine

    def order(self, order_id: str = "o1") -> tuple[Any, ...]:
        with self.engine.connect() as c:
            o = self.orders.c
            return tuple(
                c.execute(
                    select(o.status, o.fence_token, o.paid_by).where(o.order_id == order_id)
                ).one()
            )

    def balance(self) -> int:
        with self.engine.connect() as c:
            value = c.execute(select(self.accounts.c.balance)).scalar_one()
            return int(value)

    def apply(self, event: str, key: str = "o1", **kw: Any) -> TransitionResult:
        with self.engine.begin() as conn:
            return self.machine.apply(conn, key, event, **kw)


@pytest.fixture
def db(sql_url: str) -> Iterator[Db]:
    name = unique("sm")
    md = MetaData()
    orders = Table(
        f"{name}_orders",
        md,
        Column("order_id", String(64), primary_key=True),
        Column("status", String(32), nullable=False),
        Column("fence_token", BigInteger),
        Column("paid_by", String(128)),
    )
    accounts = Table(
        f"{name}_accounts",
        md,
        Column("account_id", String(64), primary_key=True),
        Column("balance", Integer, nullable=False),
    )
    engine = make_engine(sql_url)
    md.create_all(engine)
    with engine.begin() as c:
        c.execute(orders.insert().values(order_id="o1", status="PENDING_PAYMENT"))
        c.execute(accounts.insert().values(account_id="a1", balance=1000))
    machine = StateMachine(
        orders.name,
        "order_id",
        "status",
        states=STATES,
        transitions={
            "pay": (("PENDING_PAYMENT", "PAYMENT_FAILED"), "PAID"),
            "ship": ("PAID", "SHIPPED"),
            "fail_payment": ("PENDING_PAYMENT", "PAYMENT_FAILED"),
        },
    )
    try:
        yield Db(engine, sql_url, orders, accounts, machine)
    finally:
        md.drop_all(engine)
        engine.dispose()


def test_ship_before_pay_is_rejected_then_applied_after_pay(db: Db) -> None:
    assert db.apply("ship") is R.REJECTED
    assert db.order() == ("PENDING_PAYMENT", None, None)
    assert db.apply("pay", extra_values={"paid_by": "m1"}) is R.APPLIED
    assert db.apply("ship") is R.APPLIED
    assert db.order() == ("SHIPPED", None, "m1")


def test_repay_and_pay_after_ship_are_already_applied_and_write_nothing(db: Db) -> None:
    assert db.apply("pay", extra_values={"paid_by": "m1"}) is R.APPLIED
    assert db.apply("pay", extra_values={"paid_by": "m2"}) is R.ALREADY_APPLIED
    assert db.order() == ("PAID", None, "m1")  # extra values travel only with the transition
    assert db.apply("ship") is R.APPLIED
    assert db.apply("pay", extra_values={"paid_by": "m3"}) is R.ALREADY_APPLIED
    assert db.apply("ship") is R.ALREADY_APPLIED
    assert db.order() == ("SHIPPED", None, "m1")


def test_several_source_states(db: Db) -> None:
    assert db.apply("fail_payment") is R.APPLIED
    assert db.order()[0] == "PAYMENT_FAILED"
    assert db.apply("pay") is R.APPLIED  # PAYMENT_FAILED is a source of "pay" too
    assert db.apply("fail_payment") is R.ALREADY_APPLIED  # PAID is past PAYMENT_FAILED
    assert db.order()[0] == "PAID"


def test_missing_row_is_not_found(db: Db) -> None:
    assert db.apply("pay", key="nope") is R.NOT_FOUND
    assert db.order()[0] == "PENDING_PAYMENT"


def test_rolled_back_transition_leaves_no_trace(db: Db) -> None:
    with db.engine.connect() as conn:
        trans = conn.begin()
        assert db.machine.apply(conn, "o1", "pay") is R.APPLIED
        trans.rollback()  # e.g. the handler failed after the transition
    assert db.order() == ("PENDING_PAYMENT", None, None)
    assert db.apply("pay") is R.APPLIED


def test_fenced_write_with_older_token_is_refused(db: Db) -> None:
    assert db.apply("pay", fence=5) is R.APPLIED
    assert db.order() == ("PAID", 5, None)
    assert db.apply("ship", fence=4) is R.FENCED  # a paused ex-holder of the lock
    assert db.order() == ("PAID", 5, None)
    assert db.apply("ship", fence=5) is R.APPLIED  # the same holder again: allowed
    assert db.order() == ("SHIPPED", 5, None)
    assert db.apply("ship", fence=3) is R.ALREADY_APPLIED  # effect in place: nothing to fence


def test_unfenced_row_accepts_first_token_and_newer_ones(db: Db) -> None:
    assert db.apply("fail_payment") is R.APPLIED  # no fence: column untouched
    assert db.order() == ("PAYMENT_FAILED", None, None)
    assert db.apply("pay", fence=9) is R.APPLIED
    assert db.apply("ship", fence=10) is R.APPLIED
    assert db.order() == ("SHIPPED", 10, None)


def test_row_in_unconfigured_state_is_a_configuration_error(db: Db) -> None:
    with db.engine.begin() as c:
        c.execute(update(db.orders).values(status="LOST_IN_SPACE"))
    with pytest.raises(ConfigurationError, match="LOST_IN_SPACE"):
        db.apply("pay")


def test_database_errors_are_translated_with_cause(db: Db) -> None:
    ghost = StateMachine(
        unique("ghost"),
        "order_id",
        "status",
        states=STATES,
        transitions={"pay": (STATES[0], "PAID")},
    )
    with pytest.raises(StoreError) as info, db.engine.begin() as conn:
        ghost.apply(conn, "o1", "pay")
    assert info.value.__cause__ is not None
    assert type(info.value.__cause__).__module__.startswith("sqlalchemy")


@pytest.mark.slow
def test_racing_pay_with_distinct_message_ids_debits_once(db: Db) -> None:
    barrier = threading.Barrier(WORKERS)
    verdicts: list[TransitionResult] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with db.engine.connect() as conn:
                barrier.wait(timeout=30)
                with conn.begin():
                    verdict = db.machine.apply(conn, "o1", "pay", {"paid_by": f"msg-{n}"})
                    if verdict is R.APPLIED:
                        conn.execute(
                            update(db.accounts).values(balance=db.accounts.c.balance - 100)
                        )
                        # Hold the row lock a moment so the losers' UPDATEs really queue on it
                        # and must re-check the WHERE against the committed PAID row.
                        time.sleep(0.05)
                verdicts.append(verdict)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(verdicts) == sorted([R.APPLIED] + [R.ALREADY_APPLIED] * (WORKERS - 1))
    assert db.balance() == 900
    status, _, paid_by = db.order()
    assert status == "PAID"
    assert paid_by.startswith("msg-")


def test_stale_snapshot_still_classifies_from_the_current_row(db: Db) -> None:
    # MariaDB's REPEATABLE READ: a plain SELECT after the UPDATE would answer from the snapshot
    # taken by the first read below (PENDING_PAYMENT) although the UPDATE saw the committed PAID
    # row. The locking probe reads the current row, so the verdict is ALREADY_APPLIED.
    if db.url.startswith("sqlite"):
        pytest.skip("SQLite serialises whole transactions: no stale snapshot to test")
    with db.engine.connect() as late:
        trans = late.begin()
        assert late.execute(select(db.orders.c.status)).scalar_one() == "PENDING_PAYMENT"
        assert db.apply("pay", extra_values={"paid_by": "first"}) is R.APPLIED
        assert db.machine.apply(late, "o1", "pay", {"paid_by": "late"}) is R.ALREADY_APPLIED
        trans.commit()
    assert db.order() == ("PAID", None, "first")


# -- async twin --------------------------------------------------------------------------------


def async_url(url: str) -> str:
    if url.startswith("sqlite://"):
        return "sqlite+aiosqlite://" + url[len("sqlite://") :]
    return url.replace("mysql+pymysql://", "mysql+asyncmy://")  # psycopg is sync and async


def require_greenlet() -> None:
    try:
        import greenlet  # noqa: F401, PLC0415
    except ImportError:
        if CI:
            pytest.fail("greenlet (sqlalchemy[asyncio]) is not installed")
        pytest.skip("greenlet (sqlalchemy[asyncio]) is not installed")


async def test_async_twin_gives_the_same_verdicts(db: Db) -> None:
    require_greenlet()
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: PLC0415

    engine = create_async_engine(async_url(db.url), connect_args=_async_connect_args(db.url))
    if db.url.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", _autocommit_driver)
        event.listen(engine.sync_engine, "begin", _begin_immediate)
    sm = db.machine
    try:
        async with engine.begin() as conn:
            assert await sm.apply_async(conn, "o1", "ship") is R.REJECTED
            assert await sm.apply_async(conn, "nope", "pay") is R.NOT_FOUND
            assert await sm.apply_async(conn, "o1", "pay", {"paid_by": "m1"}, fence=3) is R.APPLIED
            assert await sm.apply_async(conn, "o1", "pay") is R.ALREADY_APPLIED
            assert await sm.apply_async(conn, "o1", "ship", fence=2) is R.FENCED
        assert db.order() == ("PAID", 3, "m1")

        async def racer(n: int) -> TransitionResult:
            async with engine.begin() as conn:
                verdict = await sm.apply_async(conn, "o1", "ship", fence=3 + n)
                if verdict is R.APPLIED:
                    await conn.execute(
                        update(db.accounts).values(balance=db.accounts.c.balance - 100)
                    )
                return verdict

        verdicts = await asyncio.gather(*(racer(n) for n in range(4)))
        assert verdicts.count(R.APPLIED) == 1
        assert set(verdicts) <= {R.APPLIED, R.ALREADY_APPLIED}
        async with AsyncSession(engine) as session, session.begin():
            assert await sm.apply_async(session, "o1", "pay") is R.ALREADY_APPLIED
    finally:
        await engine.dispose()
    assert db.balance() == 900
    assert db.order()[0] == "SHIPPED"


def _async_connect_args(url: str) -> dict[str, Any]:
    return {"timeout": 30} if url.startswith("sqlite") else {}


def _autocommit_driver(dbapi_conn: Any, _rec: Any) -> None:
    dbapi_conn.isolation_level = None


def _begin_immediate(conn: Any) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def test_mixed_case_identifiers(db: Db) -> None:
    # Mixed-case names are quoted by the dialect, consistently with a Core-created table.
    md = MetaData()
    t = Table(
        unique("Mixed"), md, Column("Id", String(8), primary_key=True), Column("St", String(8))
    )
    md.create_all(db.engine)
    try:
        with db.engine.begin() as c:
            c.execute(t.insert().values(Id="k", St="A"))
        sm = StateMachine(t.name, "Id", "St", states=["A", "B"], transitions={"go": ("A", "B")})
        with db.engine.begin() as c:
            assert sm.apply(c, "k", "go") is R.APPLIED
            assert c.execute(select(t.c.St)).scalar_one() == "B"
    finally:
        md.drop_all(db.engine)


def test_fencing_with_real_redis_lock_tokens(db: Db, redis_url: str) -> None:
    # The token comes from idemq.RedisLock: a holder whose lock was taken over (here: released
    # and re-acquired by someone else) carries an older token and is fenced off.
    import redis  # noqa: PLC0415

    from idemq.lock.redis_lock import RedisLock  # noqa: PLC0415

    client = redis.Redis.from_url(redis_url)
    name = unique("lock")
    try:
        stale = RedisLock(client, name, ttl_s=30)
        assert stale.acquire(blocking=False)
        old_token = stale.fencing_token
        stale.release()
        fresh = RedisLock(client, name, ttl_s=30)
        assert fresh.acquire(blocking=False)
        assert fresh.fencing_token > old_token
        assert db.apply("pay", fence=fresh.fencing_token) is R.APPLIED
        fresh.release()
        assert db.apply("ship", fence=old_token) is R.FENCED
        assert db.order() == ("PAID", fresh.fencing_token, None)
    finally:
        leftovers = client.keys(f"idemq:lock*{name}*")
        if leftovers:
            client.delete(*leftovers)
        client.close()


def test_lock_wait_timeout_is_a_retryable_conflict(db: Db) -> None:
    # A writer stuck behind another transaction's row lock gives up as StoreConflictError (roll
    # back, run the message again), not as a raw driver error.
    quick_timeout = {
        "sqlite": "",  # the busy timeout of the engine below
        "postgresql": "SET lock_timeout = '200ms'",
        "mysql": "SET SESSION innodb_lock_wait_timeout = 1",
    }
    backend = db.engine.dialect.name
    impatient = (
        create_engine(db.url, connect_args={"timeout": 0.2}) if backend == "sqlite" else db.engine
    )
    try:
        with db.engine.connect() as holder, impatient.connect() as waiter:
            holder_tx = holder.begin()
            assert db.machine.apply(holder, "o1", "fail_payment") is R.APPLIED  # holds the lock
            waiter_tx = waiter.begin()
            if quick_timeout[backend]:
                waiter.exec_driver_sql(quick_timeout[backend])
            with pytest.raises(StoreConflictError) as info:
                db.machine.apply(waiter, "o1", "pay")
            assert info.value.__cause__ is not None
            waiter_tx.rollback()
            holder_tx.rollback()
    finally:
        if impatient is not db.engine:
            impatient.dispose()
    assert db.order()[0] == "PENDING_PAYMENT"


def test_each_kind_of_call_keeps_its_own_statement(db: Db) -> None:
    """Statements are built once per kind of call (extra columns, fence): interleaved kinds on
    one machine must each write exactly their own columns."""
    with db.engine.begin() as c:
        for order_id in ("o2", "o3", "o4"):
            c.execute(db.orders.insert().values(order_id=order_id, status="PENDING_PAYMENT"))
    assert db.apply("pay", "o1", extra_values={"paid_by": "m1"}) is R.APPLIED
    assert db.apply("pay", "o2", fence=5) is R.APPLIED
    assert db.apply("pay", "o3", extra_values={"paid_by": "m3"}, fence=7) is R.APPLIED
    assert db.apply("fail_payment", "o4") is R.APPLIED
    assert db.apply("pay", "o4", fence=2) is R.APPLIED
    assert db.apply("pay", "o1", fence=9) is R.ALREADY_APPLIED
    assert db.apply("ship", "o3", fence=6) is R.FENCED
    assert [db.order(o) for o in ("o1", "o2", "o3", "o4")] == [
        ("PAID", None, "m1"),
        ("PAID", 5, None),
        ("PAID", 7, "m3"),
        ("PAID", 2, None),
    ]
    with pytest.raises(ConfigurationError, match="managed by the guard"):
        db.apply("pay", "o1", extra_values={"status": "SHIPPED"})


def test_uuid_keys_are_converted_as_core_would(sql_url: str) -> None:
    """A ``uuid.UUID`` key is bound with the type SQLAlchemy infers for it (CHAR(32) hex on
    SQLite and MariaDB, native UUID on PostgreSQL), so it finds the row Core wrote."""
    md = MetaData()
    orders = Table(
        unique("smuuid"),
        md,
        Column("order_id", Uuid, primary_key=True),
        Column("status", String(32), nullable=False),
        Column("fence_token", BigInteger),
    )
    engine = make_engine(sql_url)
    md.create_all(engine)
    key = uuid.uuid4()
    machine = StateMachine(
        orders.name,
        "order_id",
        "status",
        states=STATES,
        transitions={"pay": ("PENDING_PAYMENT", "PAID")},
    )
    try:
        with engine.begin() as c:
            c.execute(orders.insert().values(order_id=key, status="PENDING_PAYMENT"))
        with engine.begin() as c:
            assert machine.apply(c, key, "pay") is R.APPLIED
            assert machine.apply(c, key, "pay") is R.ALREADY_APPLIED
            assert machine.apply(c, uuid.uuid4(), "pay") is R.NOT_FOUND
        with engine.connect() as c:
            assert c.execute(select(orders.c.status)).scalars().all() == ["PAID"]
    finally:
        md.drop_all(engine)
        engine.dispose()


def test_orm_sessions_run_it_in_their_transaction(db: Db) -> None:
    with Session(db.engine) as session:
        with session.begin():
            assert db.machine.apply(session, "o1", "pay", {"paid_by": "orm"}) is R.APPLIED
        assert db.order() == ("PAID", None, "orm")

        def ship_then_fail() -> None:
            with session.begin():
                assert db.machine.apply(session, "o1", "ship") is R.APPLIED
                raise RuntimeError("roll back")

        with pytest.raises(RuntimeError):
            ship_then_fail()
    assert db.order() == ("PAID", None, "orm")


def test_a_used_machine_pickles_for_process_pools(db: Db) -> None:
    """A machine holds no statements or connections (they are cached beside it), so one that
    has run can still be sent to a process pool's workers."""
    assert db.apply("pay") is R.APPLIED
    clone = pickle.loads(pickle.dumps(db.machine))
    with db.engine.begin() as c:
        assert clone.apply(c, "o1", "ship") is R.APPLIED
    assert db.order()[0] == "SHIPPED"


@pytest.mark.parametrize("prefix", ["", "b_", "_b_"])
def test_columns_named_like_the_guards_own_binds(sql_url: str, prefix: str) -> None:
    """A column may be called anything a bind of the guard is called (``key``, ``target``,
    ``b_key`` …): ``Connection.execute`` would turn a parameter named like a column into one
    more SET entry, so the guards name their binds apart from the table's columns."""
    md = MetaData()
    rows = Table(
        unique("smnames"),
        md,
        Column(f"{prefix}key", String(64), primary_key=True),
        Column(f"{prefix}target", String(32), nullable=False),
        Column(f"{prefix}fence", BigInteger),
        Column(f"{prefix}version", Integer, nullable=False),
        Column(f"{prefix}extra0", String(32)),
    )
    engine = make_engine(sql_url)
    md.create_all(engine)
    machine = StateMachine(
        rows.name,
        f"{prefix}key",
        f"{prefix}target",
        states=STATES,
        transitions={"pay": ("PENDING_PAYMENT", "PAID")},
        fence_column=f"{prefix}fence",
    )
    try:
        with engine.begin() as c:
            c.execute(
                rows.insert().values(
                    {
                        f"{prefix}key": "o1",
                        f"{prefix}target": "PENDING_PAYMENT",
                        f"{prefix}version": 0,
                    }
                )
            )
        with engine.begin() as c:
            extra = {f"{prefix}extra0": "m1"}
            assert machine.apply(c, "o1", "pay", extra, fence=3) is R.APPLIED
            assert machine.apply(c, "o1", "pay", fence=3) is R.ALREADY_APPLIED
            assert versioned_update(
                c,
                rows.name,
                f"{prefix}key",
                "o1",
                0,
                {f"{prefix}extra0": "m2"},
                f"{prefix}version",
                fence=4,
                fence_column=f"{prefix}fence",
            )
        with engine.connect() as c:
            assert tuple(c.execute(select(rows)).one()) == ("o1", "PAID", 4, 1, "m2")
    finally:
        md.drop_all(engine)
        engine.dispose()
