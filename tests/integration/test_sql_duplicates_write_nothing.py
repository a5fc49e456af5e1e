"""On PostgreSQL a lease-mode duplicate writes nothing: no row lock, no transaction id, no WAL.

Robust to other sessions writing to the same server (other tests, other helpers): instead of
comparing WAL positions, each of the store's own transactions is asked, just before it commits,
whether it was given a transaction id (``pg_current_xact_id_if_assigned()``). PostgreSQL assigns
one at a transaction's first write or row lock, and a transaction without one commits without
writing WAL. The first deliveries are the control: they write, and the probe sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event

import idemq
from idemq._clock import system_clock_ms
from idemq.stores.base import ClaimRequest, Key
from tests.conftest import PG_URL, require_service, unique

DUPLICATES = 1000


class XidProbe:
    """The transaction id (or None) of every transaction the engine commits, in order."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.xids: list[str | None] = []
        event.listen(engine, "commit", self._before_commit)

    def _before_commit(self, conn: Any) -> None:
        with conn.connection.driver_connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_xact_id_if_assigned()::text")
            self.xids.append(cursor.fetchone()[0])

    def take(self) -> list[str | None]:
        taken, self.xids = self.xids, []
        return taken

    def close(self) -> None:
        event.remove(self.engine, "commit", self._before_commit)


@pytest.fixture(params=["store", "client"])
def store(request: pytest.FixtureRequest) -> Iterator[idemq.SqlStore]:
    require_service("postgres")
    made = idemq.SqlStore(PG_URL, table=unique("mi"), lease_clock=request.param)
    made.create_schema()
    yield made
    made.drop_schema()
    made.close()


def test_a_thousand_lease_mode_duplicates_take_no_transaction_id(store):
    guard = idemq.Idempotency(store, consumer="dups", mode="lease", lease_s=60)
    probe = XidProbe(store.engine)
    try:
        done = [f"D{i:02d}" for i in range(10)]
        for message_id in done:
            assert guard.process(message_id, lambda tx: "ok").status is idemq.Status.PROCESSED
        first = probe.take()
        assert len(first) == 20  # claim + complete per message
        assert all(xid is not None for xid in first)  # the control: writes are seen
        live = [f"L{i:02d}" for i in range(10)]
        for message_id in live:  # another worker's live leases
            holder = ClaimRequest(
                Key("dups", message_id), None, None, "h" * 32, system_clock_ms(), 600_000
            )
            assert store.claim(holder).acquired
        probe.take()

        statuses = set()
        for i in range(DUPLICATES):
            ids = done if i % 2 else live
            outcome = guard.process(ids[i % 10], lambda tx: "never")
            statuses.add(outcome.status)
        xids = probe.take()
    finally:
        probe.close()
    assert statuses == {idemq.Status.DUPLICATE, idemq.Status.IN_PROGRESS}
    assert len(xids) == DUPLICATES
    assert xids == [None] * DUPLICATES


def test_an_expired_lease_is_still_taken_over_once(store):
    """The takeover is now its own UPDATE: racing takeovers of one expired lease, one wins."""

    crashed = ClaimRequest(Key("dups", "X"), None, None, "c" * 32, 0, 1)
    assert store.claim(crashed).acquired
    threading.Event().wait(0.05)
    far = idemq.Idempotency(store, consumer="dups", mode="lease", clock=lambda: 10**13)
    runs: list[str] = []
    gate = threading.Barrier(8)

    def redeliver() -> None:
        gate.wait()
        far.process("X", lambda tx: runs.append("X"))

    threads = [threading.Thread(target=redeliver) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert runs == ["X"]
    record = store.get("X", "dups")
    assert record is not None
    assert record.status is idemq.RecordStatus.PROCESSED
    assert record.attempts == 2
