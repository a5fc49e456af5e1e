"""SQLite's relays hold rows by leases: a relay stalled inside a publish keeps its rows (renewal),
and a relay whose lease was taken over publishes and deletes none of them (the fence)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.outbox import BatchResult, outbox_stats
from tests.conftest import unique
from tests.integration.test_outbox import drain

LEASE_S = 0.6


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[idemq.Outbox]:
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'outbox.db'}")
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    opened = open_broker(f"embedded://{tmp_path / 'queue.db'}")
    yield opened
    opened.close()


class StallingBroker:
    """The real embedded broker; the first publish waits for ``release`` (a relay stalled in
    ``publish``, as behind a slow confirm), telling ``entered`` it got there."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def publish(self, queue: str, body: bytes, **kw: Any) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60), "never released"
        self.inner.publish(queue, body, **kw)

    def close(self) -> None:
        return None


def _add(box: idemq.Outbox, queue: str, count: int) -> list[str]:
    with box.engine.begin() as conn:
        return [box.add(conn, queue, b"%d" % n) for n in range(count)]


def _stalled(relay: idemq.OutboxRelay) -> tuple[threading.Thread, list[BatchResult]]:
    results: list[BatchResult] = []
    thread = threading.Thread(target=lambda: results.append(relay.run_once()))
    thread.start()
    return thread, results


def test_a_relay_stalled_in_publish_past_its_lease_keeps_its_rows(
    outbox: idemq.Outbox, broker: Broker
) -> None:
    queue = unique("q")
    made = _add(outbox, queue, 5)
    stalling = StallingBroker(broker)
    slow = idemq.OutboxRelay(outbox, stalling, lease_s=LEASE_S)  # type: ignore[arg-type]
    rival = idemq.OutboxRelay(outbox, broker, lease_s=LEASE_S)
    thread, results = _stalled(slow)
    try:
        assert stalling.entered.wait(30)
        # The rival keeps trying for four leases while the slow relay sits inside its publish.
        taken: list[str] = []
        deadline = time.monotonic() + 4 * LEASE_S
        while time.monotonic() < deadline:
            taken += rival.run_once().published
        assert taken == []
    finally:
        stalling.release.set()
        thread.join(60)
        rival.close()
        slow.close()
    assert sorted(results[0].published) == sorted(made)
    assert outbox_stats(outbox).pending == 0
    assert sorted(g[0] for g in drain(broker, queue)) == sorted(made)  # each row once


def test_a_relay_whose_leases_were_taken_over_publishes_and_deletes_none_of_them(
    outbox: idemq.Outbox, broker: Broker
) -> None:
    # The slow relay's clock is far behind the rival's (a skewed host): every lease it takes or
    # renews is already over in the rival's eyes, so the rival takes the rows over while the
    # slow relay is stalled in its first publish, and stalls in its own first publish too. Then
    # the slow relay goes on: its first copy is on its way (it cannot be called back), but every
    # later row, held by the rival now, must be left to the rival, and its delete must not
    # touch the row the rival holds.
    queue = unique("q")
    skew_ms = 3_600_000
    made = _add(  # due in both relays' eyes
        idemq.Outbox(outbox.store, table=outbox.table, clock=lambda: outbox.clock() - 2 * skew_ms),
        queue,
        5,
    )
    slow_broker, rival_broker = StallingBroker(broker), StallingBroker(broker)
    slow = idemq.OutboxRelay(
        outbox,
        slow_broker,  # type: ignore[arg-type]
        lease_s=LEASE_S,
        clock=lambda: outbox.clock() - skew_ms,
    )
    rival = idemq.OutboxRelay(outbox, rival_broker, lease_s=3600)  # type: ignore[arg-type]
    slow_thread, slow_results = _stalled(slow)
    rival_thread: threading.Thread | None = None
    rival_results: list[BatchResult] = []
    try:
        assert slow_broker.entered.wait(30)
        rival_thread, rival_results = _stalled(rival)
        assert rival_broker.entered.wait(30)  # the rival holds all five rows, sending the first
        # The slow relay's renewals go on meanwhile: they must not touch the rival's leases (a
        # renewal from the lagging clock would end them, and a third relay would take the rows).
        third = idemq.OutboxRelay(outbox, broker, lease_s=LEASE_S)
        taken: list[str] = []
        deadline = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < deadline:
            taken += third.run_once().published
        third.close()
        assert taken == []
        slow_broker.release.set()
        slow_thread.join(60)
        assert sorted(outbox_stats_ids(outbox)) == sorted(made)  # nothing deleted by the slow one
    finally:
        slow_broker.release.set()
        rival_broker.release.set()
        slow_thread.join(60)
        if rival_thread is not None:
            rival_thread.join(60)
        rival.close()
        slow.close()
    first = slow_results[0]
    assert len(first.published) == 1  # the one publish under way at the takeover
    assert sorted(first.lost) == sorted(set(made) - set(first.published))
    assert sorted(rival_results[0].published) == sorted(made)
    got = [g[0] for g in drain(broker, queue)]
    assert sorted(got) == sorted([*made, *first.published])  # no other row twice
    assert outbox_stats(outbox).pending == 0


def outbox_stats_ids(box: idemq.Outbox) -> list[str]:
    with box.engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {box.table}"))]
