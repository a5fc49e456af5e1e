"""Each row of the README's guarantees table, attacked with SIGKILL at the worst moments.

Row 1 — SQL transactional: a crash anywhere is either a rollback (no effect, no dedup row) or a
commit that the redelivery sees as a duplicate. Row 2 — lease mode: a crash between the effect
and ``complete`` makes the retry (after the lease expires) run the effect again: at least once
for an effect elsewhere, exactly once when a business guard (here the state machine) absorbs it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq._clock import system_clock_ms
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, require_service, unique

MESSAGE = "PAY_20240115143000123_NODE01_0001"
LEASE_S = 30.0


def business_tables(name: str) -> tuple[sa.MetaData, sa.Table, sa.Table]:
    meta = sa.MetaData()
    orders = sa.Table(
        f"{name}_orders",
        meta,
        sa.Column("order_id", sa.String(32), primary_key=True),
        sa.Column("status", sa.String(32), nullable=False),
    )
    debits = sa.Table(
        f"{name}_debits",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(32), nullable=False),
    )
    return meta, orders, debits


@pytest.fixture(params=["sqlite", "postgres", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'biz.db'}"
    require_service("postgres" if request.param == "postgres" else "mysql")
    return PG_URL if request.param == "postgres" else MYSQL_URL


@pytest.fixture
def business(db_url: str) -> Iterator[tuple[str, str]]:
    """(url, table-name prefix) of an orders + debits schema with order o1 PENDING."""
    name = unique("g")
    meta, orders, _ = business_tables(name)
    engine = sa.create_engine(db_url)
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(orders.insert().values(order_id="o1", status="PENDING"))
    yield db_url, name
    meta.drop_all(engine)
    engine.dispose()


def debit_count(url: str, name: str) -> int:
    _, _, debits = business_tables(name)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        count = conn.execute(sa.select(sa.func.count()).select_from(debits)).scalar_one()
    engine.dispose()
    return int(count)


def run_in_child(target: Callable[..., None], *args: Any) -> int | None:
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(timeout=60)
    return child.exitcode


# -- row 1: SQL transactional ------------------------------------------------------------------


def _transactional_worker(url: str, name: str, table: str, kill_after_commit: bool) -> None:
    _, _, debits = business_tables(name)
    store = idemq.SqlStore(url, table=table)
    guard = idemq.Idempotency(store, consumer="pay")

    def pay(tx: sa.Connection) -> str:
        tx.execute(debits.insert().values(order_id="o1"))
        if not kill_after_commit:
            os.kill(os.getpid(), signal.SIGKILL)  # effect written, nothing committed
        return "paid"

    guard.process(MESSAGE, pay)
    os.kill(os.getpid(), signal.SIGKILL)  # committed; the ack never happens


@pytest.mark.parametrize("kill_after_commit", [False, True], ids=["before-commit", "before-ack"])
def test_transactional_crash_anywhere_is_rollback_or_duplicate(business, kill_after_commit):
    url, name = business
    store = idemq.SqlStore(url, table=unique("mi"))
    store.create_schema()
    try:
        exitcode = run_in_child(
            _transactional_worker, url, name, store.table.name, kill_after_commit
        )
        assert exitcode == -signal.SIGKILL
        assert debit_count(url, name) == (1 if kill_after_commit else 0)

        _, _, debits = business_tables(name)
        redelivery = idemq.Idempotency(store, consumer="pay").process(
            MESSAGE, lambda tx: tx.execute(debits.insert().values(order_id="o1")) and "paid"
        )
        assert redelivery.status is (
            idemq.Status.DUPLICATE if kill_after_commit else idemq.Status.PROCESSED
        )
        assert redelivery.result == "paid"
        assert debit_count(url, name) == 1
    finally:
        store.drop_schema()
        store.close()


# -- row 2: lease mode, effect elsewhere -------------------------------------------------------


@pytest.fixture(params=["postgres-lease", "redis"])
def lease_store_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(store URL, table or prefix) of a lease store."""
    if request.param == "redis":
        require_service("redis")
        yield REDIS_URL, unique("idemqg")
        return
    require_service("postgres")
    store = idemq.SqlStore(PG_URL, table=unique("mi"))
    store.create_schema()
    yield PG_URL, store.table.name
    store.drop_schema()
    store.close()


def open_lease_store(url: str, scope: str) -> Any:
    # The guard's clock judges leases, so the test below can expire one with an injected clock
    # (tests/contract/test_store_clock.py covers the store's clock and real expiry).
    if url.startswith("redis://"):
        return idemq.RedisStore(url, prefix=scope, lease_clock="client")
    return idemq.SqlStore(url, table=scope, lease_clock="client")


def pay_elsewhere(url: str, name: str, guarded: bool) -> Callable[[Any], str]:
    """The effect lives in another database than the dedup store (committed on its own)."""
    _, orders, debits = business_tables(name)
    machine = idemq.StateMachine(
        orders.name,
        "order_id",
        "status",
        states=["PENDING", "PAID"],
        transitions={"pay": ("PENDING", "PAID")},
    )

    def pay(_tx: Any) -> str:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            verdict = machine.apply(conn, "o1", "pay") if guarded else None
            if not guarded or verdict is idemq.TransitionResult.APPLIED:
                conn.execute(debits.insert().values(order_id="o1"))
        engine.dispose()
        return "paid"

    return pay


def _lease_worker(store_url: str, scope: str, url: str, name: str, guarded: bool) -> None:
    guard = idemq.Idempotency(
        open_lease_store(store_url, scope), consumer="pay", mode="lease", lease_s=LEASE_S
    )
    effect = pay_elsewhere(url, name, guarded)

    def pay_then_die(tx: Any) -> str:
        effect(tx)
        os.kill(os.getpid(), signal.SIGKILL)  # effect done, complete() never runs
        return "unreachable"

    guard.process(MESSAGE, pay_then_die)


@pytest.mark.parametrize("guarded", [False, True], ids=["bare-effect", "state-machine"])
def test_lease_crash_between_effect_and_complete(lease_store_url, business, guarded):
    store_url, scope = lease_store_url
    url, name = business
    assert run_in_child(_lease_worker, store_url, scope, url, name, guarded) == -signal.SIGKILL
    assert debit_count(url, name) == 1

    store = open_lease_store(store_url, scope)
    try:
        now = idemq.Idempotency(store, consumer="pay", mode="lease", lease_s=LEASE_S)
        assert now.process(MESSAGE, pay_elsewhere(url, name, guarded)).status is (
            idemq.Status.IN_PROGRESS
        ), "the dead worker's lease is still live: nobody may run it yet"

        later = idemq.Idempotency(  # the lease has expired (clock injected, no sleeping)
            store,
            consumer="pay",
            mode="lease",
            lease_s=LEASE_S,
            clock=lambda: system_clock_ms() + int(LEASE_S * 1000) + 1,
        )
        retried = later.process(MESSAGE, pay_elsewhere(url, name, guarded))
        assert retried.status is idemq.Status.PROCESSED
        # At least once for a bare effect elsewhere; exactly once behind the state machine.
        assert debit_count(url, name) == (1 if guarded else 2)
        assert later.process(MESSAGE, pay_elsewhere(url, name, guarded)).status is (
            idemq.Status.DUPLICATE
        )
    finally:
        store.close()
