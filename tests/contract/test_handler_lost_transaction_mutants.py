"""A handler's statement that loses the transaction (a lock timeout: PostgreSQL rolled it back)
is a store conflict, not the handler's own error: the guard runs the transaction again, a
bounded number of times, and nothing of it commits. Mutation testing (docs/how-we-know.md)
found that no test of the fast loop handed the handler's error on to the store to judge.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import idemq
from idemq.guard.core import CLAIM_ATTEMPTS
from tests.conftest import PG_URL, require_service, unique


@pytest.fixture
def pg_store() -> Iterator[idemq.SqlStore]:
    require_service("postgres")
    store = idemq.SqlStore(PG_URL, table=unique("mi"))
    store.create_schema()
    yield store
    store.drop_schema()
    store.close()


@pytest.fixture
def accounts(pg_store: idemq.SqlStore) -> Iterator[sa.Table]:
    """One account row, balance 0: the business effect is its increment."""
    table = sa.Table(
        unique("acct"),
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("balance", sa.Integer, nullable=False),
    )
    table.create(pg_store.engine)
    with pg_store.engine.begin() as conn:
        conn.execute(table.insert().values(id=1, balance=0))
    yield table
    table.drop(pg_store.engine)


def balance(store: idemq.SqlStore, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(table.c.balance)).scalar_one())


def test_a_lock_timeout_in_the_handler_reruns_the_transaction_then_raises_a_conflict(
    pg_store, accounts
):
    consumer = unique("c")
    guard = idemq.Idempotency(pg_store, consumer=consumer)
    runs = []

    def credit(tx: sa.Connection) -> str:
        runs.append(1)
        tx.exec_driver_sql("SET LOCAL lock_timeout = '50ms'")
        tx.execute(accounts.update().values(balance=accounts.c.balance + 1))
        return "credited"

    with pg_store.engine.connect() as blocker, blocker.begin():
        blocker.execute(sa.select(accounts).with_for_update())  # holds the row's lock
        with pytest.raises(idemq.StoreConflictError):
            guard.process("M1", credit)
        assert len(runs) == CLAIM_ATTEMPTS  # each attempt was rolled back whole and rerun

    assert balance(pg_store, accounts) == 0
    assert pg_store.get("M1", consumer) is None  # no dedup row: the message may run again

    outcome = guard.process("M1", credit)  # the lock is gone: the redelivery applies it once
    assert (outcome.status, outcome.result) == (idemq.Status.PROCESSED, "credited")
    assert balance(pg_store, accounts) == 1
