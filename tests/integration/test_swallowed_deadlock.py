"""MariaDB, transactional mode: a handler that catches a deadlock (1213) and writes again.

InnoDB rolls the whole transaction back when it picks it as a deadlock's victim; the handler's
next statement opens a new transaction, without the dedup row. Before the fix its COMMIT
committed the handler's later writes alone: the redelivery found no dedup row and applied the
effect a second time. Now the confirmation before COMMIT finds no row of its own, everything is
rolled back (TransactionLostError), idemq runs the transaction again, and the effect lands once.

The deadlock is a real one: the handler locks row ``a``, a rival connection (made the heavier
transaction, so InnoDB picks the handler as the victim) locks ``b`` and waits for ``a``, then
the handler asks for ``b``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

import idemq
from tests.conftest import server_wide, unique

DEADLOCK = 1213
DEADLINE_S = 20.0


@pytest.fixture
def store(mysql_url: str) -> Iterator[idemq.SqlStore]:
    # These tests stage a deadlock by timing two transactions against each other and watch
    # InnoDB's lock waits: alone on the server, so other tests' work (under xdist) neither
    # delays a wait past the deadline nor resolves the staged deadlock another way.
    server_wide("mysql")
    made = idemq.SqlStore(mysql_url, table=unique("mi"))
    made.create_schema()
    yield made
    made.drop_schema()
    made.close()


@pytest.fixture
def tables(store: idemq.SqlStore) -> Iterator[tuple[sa.Table, sa.Table, sa.Table]]:
    metadata = sa.MetaData()
    ledger = sa.Table(
        unique("ledger"),
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(128)),
    )
    locks = sa.Table(
        unique("locks"),
        metadata,
        sa.Column("id", sa.String(8), primary_key=True),
        sa.Column("n", sa.Integer),
    )
    filler = sa.Table(unique("filler"), metadata, sa.Column("id", sa.Integer, primary_key=True))
    metadata.create_all(store.engine)
    with store.engine.begin() as conn:
        conn.execute(locks.insert(), [{"id": "a", "n": 0}, {"id": "b", "n": 0}])
    yield ledger, locks, filler
    metadata.drop_all(store.engine)


def wait_until_blocked(engine: sa.Engine, thread_id: int) -> None:
    """Until the connection ``thread_id`` waits for a row lock (deadline: DEADLINE_S)."""
    query = sa.text(
        "SELECT COUNT(*) FROM information_schema.innodb_trx "
        "WHERE trx_mysql_thread_id = :tid AND trx_state = 'LOCK WAIT'"
    )
    deadline = time.monotonic() + DEADLINE_S
    with engine.connect() as conn:
        while conn.execute(query, {"tid": thread_id}).scalar_one() == 0:
            assert time.monotonic() < deadline, "the rival never waited for row a"
            conn.rollback()
            time.sleep(0.01)  # polling a condition under a deadline, not a fixed wait


class Rival:
    """A heavier transaction on another connection: writes filler rows, locks ``b``, then waits
    for ``a`` (held by the handler) — the other half of the deadlock."""

    def __init__(self, engine: sa.Engine, locks: sa.Table, filler: sa.Table) -> None:
        self.engine = engine
        self.locks = locks
        self.filler = filler
        self.holds_b = threading.Event()
        self.thread_id: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self.engine.begin() as conn:
                self.thread_id = conn.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()
                conn.execute(self.filler.insert(), [{"id": i} for i in range(1, 51)])
                conn.execute(self.bump("b"))
                self.holds_b.set()
                conn.execute(self.bump("a"))  # waits for the handler's lock on a
        except BaseException as exc:
            self.error = exc
            self.holds_b.set()

    def bump(self, row: str) -> Any:
        return self.locks.update().where(self.locks.c.id == row).values(n=self.locks.c.n + 1)


def test_a_handler_that_catches_a_deadlock_and_writes_again_applies_the_effect_once(store, tables):
    ledger, locks, filler = tables
    guard = idemq.Idempotency(store, consumer="orders")
    runs: list[str] = []
    rival = Rival(store.engine, locks, filler)

    def handle(tx: sa.Connection) -> None:
        first = not runs
        runs.append("run")
        if first:
            tx.execute(rival.bump("a"))
            rival.thread.start()
            assert rival.holds_b.wait(DEADLINE_S)
            assert rival.error is None, rival.error
            assert rival.thread_id is not None
            wait_until_blocked(store.engine, rival.thread_id)
            try:
                tx.execute(rival.bump("b"))
            except OperationalError as exc:
                if exc.orig is None or exc.orig.args[0] != DEADLOCK:
                    raise
                runs.append("deadlock caught")  # "retry the write", as a user would
        tx.execute(ledger.insert().values(message_id="M1"))

    first = guard.process("M1", handle)
    rival.thread.join(DEADLINE_S)
    assert rival.error is None, rival.error
    assert "deadlock caught" in runs, "InnoDB picked the rival as the victim: no test"

    redelivered = guard.process("M1", handle)  # the broker delivers it again
    with store.engine.connect() as conn:
        effects = conn.execute(sa.select(sa.func.count()).select_from(ledger)).scalar_one()

    assert first.status is idemq.Status.PROCESSED
    assert redelivered.status is idemq.Status.DUPLICATE
    assert effects == 1
    # The lost transaction was rolled back and run again by idemq (it owns it): two runs.
    assert runs == ["run", "deadlock caught", "run"]


def test_a_twins_committed_row_is_never_taken_for_the_lost_one(store, tables):
    # After the deadlock rolled the handler's transaction back, a twin delivery claims the
    # message, applies it and commits. The handler goes on in a new transaction: the dedup row
    # it now finds is the twin's (another owner), which must not pass for its own.
    ledger, locks, filler = tables
    guard = idemq.Idempotency(store, consumer="orders")
    runs: list[str] = []
    rival = Rival(store.engine, locks, filler)

    def twin(tx: sa.Connection) -> str:
        tx.execute(ledger.insert().values(message_id="M1"))
        return "twin"

    def handle(tx: sa.Connection) -> str:
        runs.append("run")
        tx.execute(rival.bump("a"))
        rival.thread.start()
        assert rival.holds_b.wait(DEADLINE_S)
        assert rival.thread_id is not None
        wait_until_blocked(store.engine, rival.thread_id)
        try:
            tx.execute(rival.bump("b"))
        except OperationalError as exc:
            if exc.orig is None or exc.orig.args[0] != DEADLOCK:
                raise
            runs.append("deadlock caught")
        outcomes: list[Any] = []
        other = threading.Thread(target=lambda: outcomes.append(guard.process("M1", twin)))
        other.start()
        other.join(DEADLINE_S)
        runs.append(outcomes[0].status.value)
        tx.execute(ledger.insert().values(message_id="M1"))
        return "first"

    first = guard.process("M1", handle)
    rival.thread.join(DEADLINE_S)
    with store.engine.connect() as conn:
        effects = conn.execute(sa.select(sa.func.count()).select_from(ledger)).scalar_one()

    assert runs == ["run", "deadlock caught", "processed"]
    # The handler's transaction was found lost and rolled back; its rerun met the twin's row.
    assert first.status is idemq.Status.DUPLICATE
    assert first.result == "twin"
    assert effects == 1


def test_a_batch_whose_last_handler_catches_a_deadlock_runs_again_whole(store, tables):
    # The deadlock rolled back the whole batch transaction: message A's effect and both dedup
    # rows. Before the fix B's later write committed alone and both were answered PROCESSED:
    # A acked with no effect (lost), B without its dedup row (doubled on redelivery).
    ledger, locks, filler = tables
    guard = idemq.Idempotency(store, consumer="orders")
    runs: list[str] = []
    rival = Rival(store.engine, locks, filler)

    def handle(msg: idemq.Message, tx: sa.Connection) -> None:
        runs.append(msg.id)
        if msg.id == "B" and runs.count("B") == 1:
            tx.execute(rival.bump("a"))
            rival.thread.start()
            assert rival.holds_b.wait(DEADLINE_S)
            assert rival.thread_id is not None
            wait_until_blocked(store.engine, rival.thread_id)
            try:
                tx.execute(rival.bump("b"))
            except OperationalError as exc:
                if exc.orig is None or exc.orig.args[0] != DEADLOCK:
                    raise
                runs.append("deadlock caught")
        tx.execute(ledger.insert().values(message_id=msg.id))

    batch = [idemq.Message(id=m, body=b"{}") for m in ("A", "B")]
    outcomes = guard.process_batch(batch, handle)
    rival.thread.join(DEADLINE_S)
    redelivered = guard.process_batch(batch, handle)
    with store.engine.connect() as conn:
        effects = sorted(conn.execute(sa.select(ledger.c.message_id)).scalars())

    assert runs == ["A", "B", "deadlock caught", "A", "B"]
    assert [o.status for o in outcomes] == [idemq.Status.PROCESSED] * 2
    assert [o.status for o in redelivered] == [idemq.Status.DUPLICATE] * 2
    assert effects == ["A", "B"]
