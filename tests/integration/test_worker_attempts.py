"""Lease mode on RabbitMQ: a handler whose own database connection drops is an outage, not an
attempt (issue 24, item 3).

In lease mode the handler writes through an engine of its own, so the guard hands its driver
error on unchanged. The worker must read a dropped connection as the database being unavailable
— retry, never count it toward dead-lettering — while a statement the server refuses is still
the handler's failure. Real PostgreSQL behind a TCP proxy the test cuts, a real RabbitMQ queue,
and a policy of one attempt: a miscounted drop would dead-letter at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from idemq import Idempotency, SqlStore
from idemq.brokers import open_broker
from idemq.brokers.base import DEAD_LETTER_REASON_HEADER, Broker
from idemq.brokers.settlement import RetryPolicy, Verdict
from idemq.message import Message
from idemq.worker.loop import Worker
from tests.conftest import PG_URL, require_service, unique
from tests.contract._proxy import CuttableProxy
from tests.contract.brokers import Running, wait_for

pytestmark = pytest.mark.rabbitmq

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
ONE_ATTEMPT = RetryPolicy(max_attempts=1, store_unavailable_delay_s=0.2, in_progress_delay_s=0.2)


class DroppingHandler:
    """Writes each message's effect through its own engine, behind a proxy it can cut.

    ``drop_during``: ids whose first run loses the connection mid-statement (checked out, then
    cut); ``drop_before``: ids whose first run cannot connect at all; ``refused``: ids whose
    statement the server rejects every time (a real handler bug: must still dead-letter).
    """

    def __init__(self, table: str, proxy: CuttableProxy) -> None:
        self.table = table
        self.proxy = proxy
        url = sa.make_url(PG_URL).set(host="127.0.0.1", port=proxy.port)
        self.engine = sa.create_engine(url, pool_size=1, max_overflow=0)
        self.drop_during: set[str] = set()
        self.drop_before: set[str] = set()
        self.refused: set[str] = set()
        self.runs: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, msg: Message, _tx: Any) -> None:
        with self._lock:
            self.runs[msg.id] += 1
            during = msg.id in self.drop_during
            before = msg.id in self.drop_before
            self.drop_during.discard(msg.id)
            self.drop_before.discard(msg.id)
        if before:
            self.engine.dispose()  # no pooled connection left: the next one must connect
            self.proxy.cut()
        try:
            with self.engine.begin() as conn:
                if during:
                    conn.execute(sa.text("SELECT 1"))  # the connection is live and checked out
                    self.proxy.cut()
                if msg.id in self.refused:
                    conn.execute(sa.text("SELECT * FROM idemq_no_such_table_here"))
                conn.execute(
                    sa.text(f"INSERT INTO {self.table} (message_id) VALUES (:m)"), {"m": msg.id}
                )
        finally:
            self.proxy.restore()


@pytest.fixture
def effects() -> Iterator[str]:
    require_service("postgres")
    table = unique("effects")
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (message_id VARCHAR(200))"))
    yield table
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table}"))
    engine.dispose()


def _counts(table: str) -> Counter[str]:
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect() as conn:
            return Counter(r[0] for r in conn.execute(sa.text(f"SELECT message_id FROM {table}")))
    finally:
        engine.dispose()


def test_a_lease_mode_handlers_dropped_connection_is_retried_not_dead_lettered(
    effects: str,
) -> None:
    require_service("rabbitmq")
    queue = unique("q")
    proxy = CuttableProxy(("127.0.0.1", 5432))
    handler = DroppingHandler(effects, proxy)
    store = SqlStore(PG_URL, table=unique("idemq"))
    store.create_schema()
    publisher = open_broker(AMQP_URL)
    publisher.declare(queue)
    try:
        during, before, refused = f"D_{queue}", f"B_{queue}", f"R_{queue}"
        handler.drop_during.add(during)
        handler.drop_before.add(before)
        handler.refused.add(refused)
        guard = Idempotency(store, consumer=unique("c"), mode="lease")
        worker = Worker(handler, open_broker(AMQP_URL), guard, queue, policy=ONE_ATTEMPT)
        running = Running(worker)
        for message_id in (during, before, refused):
            publisher.publish(queue, b"{}", message_id=message_id)
        wait_for(lambda: {during, before} <= set(_counts(effects)), 30, "both dropped messages")
        dead = _read_dead_letters(publisher, queue)
        running.stop()
        assert _counts(effects) == Counter({during: 1, before: 1})
        assert (handler.runs[during], handler.runs[before]) == (2, 2), handler.runs
        # Only the refused statement is the handler's failure: dead at its one attempt.
        assert [headers.get("idemq-message-id") for _, headers in dead] == [refused]
        assert dead[0][1][DEAD_LETTER_REASON_HEADER].startswith("handler_error: gave up after 1")
        assert worker.stats.verdicts[Verdict.STORE_UNAVAILABLE] == 2
        assert worker.stats.verdicts[Verdict.HANDLER_ERROR] == 1
        assert worker.stats.verdicts[Verdict.PROCESSED] == 2
    finally:
        publisher.delete_queue(queue)
        publisher.close()
        handler.engine.dispose()
        store.drop_schema()
        store.close()
        proxy.close()


def _read_dead_letters(broker: Broker, queue: str) -> list[tuple[bytes, dict[str, str]]]:
    """The first dead letter of ``queue`` (none within 20 s: an empty list)."""
    deadline = time.monotonic() + 20
    for delivery in broker.consume(broker.dead_letter_queue(queue), prefetch=10):
        if delivery is not None:
            delivery.ack()
            return [(delivery.body, delivery.headers)]
        if time.monotonic() > deadline:
            break
    return []
