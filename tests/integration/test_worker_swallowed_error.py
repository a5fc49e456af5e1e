"""A worker on RabbitMQ, transactional mode on PostgreSQL: a handler that swallows a database
error is never acknowledged.

PostgreSQL aborts the transaction at the failed statement and psycopg's COMMIT of it returns
normally, so before the fix the message was acked with its effect and dedup row both gone.
Now each delivery ends in TransactionLostError, counted as a failed attempt: the message is
retried, then dead-lettered with the reason, and a well-behaved message beside it is processed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from idemq import Idempotency, SqlStore
from idemq.brokers import open_broker
from idemq.brokers.base import DEAD_LETTER_REASON_HEADER, Broker
from idemq.brokers.settlement import RetryPolicy, Verdict
from idemq.guard.core import CLAIM_ATTEMPTS
from idemq.message import Message
from idemq.worker.loop import Worker
from tests.conftest import PG_URL, require_service, unique
from tests.contract.brokers import Running, wait_for

pytestmark = pytest.mark.rabbitmq

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
TWO_ATTEMPTS = RetryPolicy(max_attempts=2, backoff_base_s=0.05, backoff_max_s=0.1)


@pytest.fixture
def tables() -> Iterator[tuple[sa.Engine, sa.Table, sa.Table]]:
    require_service("postgres")
    require_service("rabbitmq")
    engine = sa.create_engine(PG_URL)
    metadata = sa.MetaData()
    ledger = sa.Table(unique("ledger"), metadata, sa.Column("message_id", sa.String(128)))
    refs = sa.Table(unique("refs"), metadata, sa.Column("ref", sa.String(32), primary_key=True))
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(refs.insert().values(ref="seen"))
    yield engine, ledger, refs
    metadata.drop_all(engine)
    engine.dispose()


def test_a_swallowed_error_is_retried_then_dead_lettered_never_acked(tables) -> None:
    engine, ledger, refs = tables
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def handle(msg: Message, tx: Any) -> None:
        with lock:
            runs[msg.id] += 1
        tx.execute(ledger.insert().values(message_id=msg.id))
        if msg.id.startswith("S_"):
            try:  # noqa: SIM105 -- the idiom as users write it, without a savepoint
                tx.execute(refs.insert().values(ref="seen"))
            except IntegrityError:
                pass

    queue = unique("q")
    store = SqlStore(PG_URL, table=unique("idemq"))
    store.create_schema()
    publisher = open_broker(AMQP_URL)
    publisher.declare(queue)
    swallower, good = f"S_{queue}", f"N_{queue}"
    try:
        guard = Idempotency(store, consumer=unique("c"))
        worker = Worker(handle, open_broker(AMQP_URL), guard, queue, policy=TWO_ATTEMPTS)
        running = Running(worker)
        publisher.publish(queue, b"{}", message_id=swallower)
        publisher.publish(queue, b"{}", message_id=good)
        dead = _read_dead_letters(publisher, queue)
        wait_for(lambda: worker.stats.verdicts[Verdict.PROCESSED] >= 1, 30, "the good message")
        running.stop()
        with engine.connect() as conn:
            effects = Counter(conn.execute(sa.select(ledger.c.message_id)).scalars())
    finally:
        publisher.delete_queue(queue)
        publisher.close()
        store.drop_schema()
        store.close()

    assert effects == Counter({good: 1})
    assert [headers.get("idemq-message-id") for _, headers in dead] == [swallower]
    reason = dead[0][1][DEAD_LETTER_REASON_HEADER]
    assert reason.startswith("handler_error: gave up after 2 attempts"), reason
    # Each delivery ran the handler once per transaction idemq opened, every one rolled back.
    assert runs[swallower] == 2 * CLAIM_ATTEMPTS
    assert worker.stats.verdicts[Verdict.HANDLER_ERROR] == 2
    assert worker.stats.verdicts[Verdict.PROCESSED] == 1  # the good one only: no silent ack


def _read_dead_letters(broker: Broker, queue: str) -> list[tuple[bytes, dict[str, str]]]:
    """The first dead letter of ``queue`` (none within 30 s: an empty list)."""
    deadline = time.monotonic() + 30
    for delivery in broker.consume(broker.dead_letter_queue(queue), prefetch=10):
        if delivery is not None:
            delivery.ack()
            return [(delivery.body, delivery.headers)]
        if time.monotonic() > deadline:
            break
    return []
