"""An outage is never counted as an attempt, however long it lasts: a broker gone for more than
``max_attempts`` relay rounds, then back, receives every row, and none is dead."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import idemq
from idemq.brokers import open_broker
from idemq.errors import BrokerError
from idemq.outbox import outbox_stats
from tests.conftest import REDIS_URL, require_service, unique
from tests.contract._proxy import CuttableProxy
from tests.integration.test_outbox_relay import receive


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[idemq.Outbox]:
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'outbox.db'}")
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


def test_an_outage_longer_than_max_attempts_rounds_kills_no_row(outbox: idemq.Outbox) -> None:
    require_service("redis")
    queue = unique("q")
    consumer = open_broker(REDIS_URL)
    consumer.declare(queue)
    proxy = CuttableProxy(("127.0.0.1", 6379))
    # The relay is handed a broker it did not open, so it keeps it through the outage (redis-py
    # reconnects on the next command): every round claims rows and fails at their publish.
    behind_proxy = open_broker(f"redis://127.0.0.1:{proxy.port}/0")
    now = [0]
    relay = idemq.OutboxRelay(
        outbox, behind_proxy, max_attempts=2, backoff_s=1, clock=lambda: now[0]
    )
    try:
        with outbox.engine.begin() as conn:
            made = [outbox.add(conn, queue, b"%d" % n, ordering_key=f"k{n % 2}") for n in range(6)]
        now[0] = outbox.clock()
        proxy.cut()
        outages = 0
        for _ in range(5):  # more rounds than max_attempts, each past any backoff
            now[0] += 600_000
            try:
                outages += relay.run_once().outage is not None
            except BrokerError:
                outages += 1
        assert outages == 5
        assert outbox_stats(outbox).dead == 0
        proxy.restore()
        # The relay's clock stands still from here: the rows the last round had claimed must
        # be free at once (released at the outage), not a lease later.
        deadline = time.monotonic() + 60
        while outbox_stats(outbox).pending and time.monotonic() < deadline:
            try:
                relay.run_once()
            except BrokerError:
                time.sleep(0.2)  # reconnecting: look again shortly
        got = receive(consumer, queue, len(made), timeout_s=60)
    finally:
        relay.close()
        behind_proxy.close()
        proxy.close()
    assert sorted(d.message.id for d in got if d.message) == sorted(made)
    stats = outbox_stats(outbox)
    assert (stats.pending, stats.dead) == (0, 0)
    consumer.delete_queue(queue)
    consumer.close()
