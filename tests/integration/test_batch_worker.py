"""``idemq worker --batch-size``: each effect once under redelivery; a poison message in a batch
is dead-lettered while the rest of the batch is acked — only after the batch committed.

Runs on the embedded queue, RabbitMQ and NATS (acks queued to the client's loop thread) and Redis
Streams (a batch's acks in one XACK); effects are rows of a business table.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import Broker, Delivery
from idemq.brokers.settlement import Verdict
from idemq.worker.batch import BatchSettings, collect
from idemq.worker.loop import Worker
from idemq.worker.run import open_guard
from tests.conftest import require_service, unique
from tests.contract.brokers import FAST, Business, Running, wait_for

BROKER_URLS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    # No crash here: AckWait only has to outlast a loaded machine's batch (else a redelivery).
    "nats": "nats://127.0.0.1:4222?ack_wait_s=10",
    "redis": "redis://127.0.0.1:6379/0?claim_idle_ms=1000",
}


@pytest.fixture(params=["embedded", "rabbitmq", "nats", "redis"])
def broker_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "embedded":
        return f"embedded://{tmp_path / 'queue.db'}?visibility_timeout_s=2"
    require_service(request.param)
    return BROKER_URLS[request.param]


@pytest.fixture
def queue() -> str:
    return unique("bq")


@pytest.fixture
def business(tmp_path: Path) -> Iterator[Business]:
    biz = Business(f"sqlite:///{tmp_path / 'business.db'}")
    yield biz
    biz.drop()


@pytest.fixture
def publisher(broker_url: str, queue: str) -> Iterator[Broker]:
    broker = open_broker(broker_url)
    broker.declare(queue)
    yield broker
    broker.delete_queue(queue)
    broker.close()


class AckAudit:
    """Wraps ``Settler.settle_many``: at every ack, the effect must already be committed."""

    def __init__(self, worker: Worker, business: Business) -> None:
        self.business = business
        self.acked_before_commit: list[str] = []
        self.settled: Counter[Verdict] = Counter()
        self._lock = threading.Lock()
        self._settle_many = worker.settler.settle_many
        worker.settler.settle_many = self.settle_many  # type: ignore[method-assign]

    def settle_many(self, judged: Sequence[tuple[Delivery, Verdict, str]]) -> list[Verdict]:
        # Read through another connection: only committed rows are visible there.
        committed = self.business.counts()
        for delivery, verdict, _ in judged:
            if verdict is Verdict.PROCESSED:
                assert delivery.message is not None
                if committed[delivery.message.id] != 1:
                    with self._lock:
                        self.acked_before_commit.append(delivery.message.id)
            with self._lock:
                self.settled[verdict] += 1
        return self._settle_many(judged)


def batch_worker(broker_url: str, queue: str, business: Business, guards: list[Any]) -> Worker:
    guard = open_guard(business.url, unique("c"))
    guards.append(guard)
    return Worker(
        business.handler,
        open_broker(broker_url),
        guard,
        queue,
        concurrency=2,
        policy=FAST,
        batch=BatchSettings(size=10, wait_ms=20),
    )


@pytest.fixture
def guards() -> Iterator[list[Any]]:
    opened: list[Any] = []
    yield opened
    for guard in opened:
        guard.store.close()


def test_each_effect_once_and_a_poison_message_is_dead_lettered_alone(
    broker_url: str, queue: str, business: Business, publisher: Broker, guards: list[Any]
) -> None:
    ids = [f"B{i:03d}_{queue}" for i in range(40)]
    poison = f"POISON_{queue}"
    business.fail_once.update(ids[::8])  # fail once after writing: the batch reruns isolated
    business.always_fail.add(poison)
    worker = batch_worker(broker_url, queue, business, guards)
    audit = AckAudit(worker, business)
    for i, message_id in enumerate(ids[:20]):
        publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
    publisher.publish(queue, b'{"n": 0}', message_id=poison)
    for i, message_id in enumerate(ids[20:], start=20):
        publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
    for i, message_id in enumerate(ids[:5]):  # producer retries: the same message again
        publisher.publish(queue, b'{"n": %d}' % i, message_id=message_id)
    running = Running(worker)
    wait_for(lambda: set(business.counts()) >= set(ids), 30, "all 40 effects")
    failures = len(ids[::8]) + FAST.max_attempts  # each forced failure once, the poison 3 times
    wait_for(lambda: audit.settled[Verdict.HANDLER_ERROR] >= failures, 30, "the failed tries")
    duplicates = 0 if broker_url.startswith("nats:") else 5
    wait_for(lambda: audit.settled[Verdict.DUPLICATE] >= duplicates, 30, "the duplicates settled")
    stats = running.stop().stats

    assert business.counts() == Counter({message_id: 1 for message_id in ids})  # poison: none
    assert not audit.acked_before_commit
    assert stats.verdicts[Verdict.PROCESSED] == 40
    # JetStream drops a re-publish of the same Nats-Msg-Id itself (its duplicate window).
    assert stats.verdicts[Verdict.DUPLICATE] == (0 if broker_url.startswith("nats:") else 5)
    assert stats.verdicts[Verdict.HANDLER_ERROR] == failures
    assert not business.fail_once  # every forced failure was really redelivered
    dead = read_dead_letters(broker_url, queue)
    assert [message_id for message_id, _ in dead] == [poison]
    assert "handler_error: gave up after 3 attempts" in dead[0][1]["idemq-dead-letter-reason"]


def read_dead_letters(broker_url: str, queue: str) -> list[tuple[str | None, dict[str, str]]]:
    """(message id, headers) of each dead letter of ``queue``."""
    broker = open_broker(broker_url)
    found: list[tuple[str | None, dict[str, str]]] = []
    deadline = time.monotonic() + 10
    try:
        for delivery in broker.consume(broker.dead_letter_queue(queue), prefetch=10):
            if delivery is not None:
                found.append((delivery.message and delivery.message.id, delivery.headers))
                delivery.ack()
            elif found or time.monotonic() > deadline:
                break
    finally:
        broker.close()
    return found


def test_a_batch_whose_store_is_down_is_retried_whole(tmp_path: Path, queue: str) -> None:
    # The store's "file" is a directory: every claim fails with StoreUnavailableError.
    (tmp_path / "not-a-db").mkdir()
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'not-a-db'}")
    broker = open_broker(f"embedded://{tmp_path / 'q.db'}")
    for i in range(3):
        broker.publish(queue, b"{}", message_id=f"S{i}")
    guard = idemq.Idempotency(store, consumer="down")
    worker = Worker(lambda msg, tx: None, broker, guard, queue, batch=BatchSettings(3))
    assert worker.batch is not None
    batch = next(collect(broker.consume(queue), BatchSettings(3, wait_ms=1000)))
    assert [d.message.id for d in batch if d.message] == ["S0", "S1", "S2"]
    assert worker.batch.handle(batch) == [Verdict.STORE_UNAVAILABLE] * 3
    assert all(d.settled for d in batch)
    assert broker.depth(queue) == 3  # retried later, nothing dead-lettered
    store.close()
    broker.close()
