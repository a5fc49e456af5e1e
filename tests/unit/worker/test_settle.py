"""The worker's settler on the embedded queue (one SQLite file, no server): each judged delivery
settled once as the policy says, a dead letter carrying its whole reason while the log line
keeps only the error's class, and a settlement the broker refused counted, never raised."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from idemq.brokers.base import DEAD_LETTER_REASON_HEADER, Delivery
from idemq.brokers.embedded import EmbeddedBroker
from idemq.brokers.settlement import RetryPolicy, Verdict
from idemq.errors import AlreadySettledError
from idemq.guard.probes import Observer
from idemq.worker.settle import Settler, WorkerStats

QUEUE = "settle-unit"
POLICY = RetryPolicy(max_attempts=2, backoff_base_s=1.0)
SECRET_DETAIL = "ValueError: card 4111-1111 declined"


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now_ms


class DeadLetters(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def dead_lettered(self, consumer: str, message_id: str, reason: str) -> None:
        self.seen.append((consumer, message_id, reason))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def broker(tmp_path: Path, clock: Clock):
    broker = EmbeddedBroker(tmp_path / "q.db", clock_ms=clock)
    yield broker
    broker.close()


def receive(broker: EmbeddedBroker, queue: str = QUEUE) -> Delivery:
    delivery = next(broker.consume(queue))
    assert delivery is not None
    return delivery


def test_processed_and_duplicate_are_acked_and_counted(broker: EmbeddedBroker):
    settler = Settler(POLICY, consumer="orders")
    broker.publish(QUEUE, b"{}", message_id="M1")
    broker.publish(QUEUE, b"{}", message_id="M1")
    first, second = receive(broker), receive(broker)
    verdicts = settler.settle_many(
        [(first, Verdict.PROCESSED, ""), (second, Verdict.DUPLICATE, "")]
    )
    assert verdicts == [Verdict.PROCESSED, Verdict.DUPLICATE]
    assert broker.depth(QUEUE) == 0
    assert str(settler.stats) == "processed=1, duplicate=1"
    assert settler.stats.deliveries == 2


def test_a_failed_handler_is_retried_as_the_next_attempt_after_its_backoff(
    broker: EmbeddedBroker, clock: Clock
):
    settler = Settler(POLICY, consumer="orders")
    broker.publish(QUEUE, b"{}", message_id="M2")
    settler.settle_many([(receive(broker), Verdict.HANDLER_ERROR, SECRET_DETAIL)])
    assert next(broker.consume(QUEUE)) is None  # not before the backoff
    clock.now_ms += 1000
    again = receive(broker)
    assert again.delivery_attempt == 2
    assert again.message is not None
    assert again.message.id == "M2"


def test_the_last_attempt_is_dead_lettered_with_the_whole_reason_but_logged_by_class(
    broker: EmbeddedBroker, clock: Clock, caplog: pytest.LogCaptureFixture
):
    observer = DeadLetters()
    settler = Settler(POLICY, consumer="orders", observer=observer)
    broker.publish(QUEUE, b"{}", message_id="M3", headers={"idemq-delivery-attempt": "2"})
    with caplog.at_level(logging.WARNING, logger="idemq.worker"):
        settler.settle_many([(receive(broker), Verdict.HANDLER_ERROR, SECRET_DETAIL)])
    dead = receive(broker, broker.dead_letter_queue(QUEUE))
    reason = dead.headers[DEAD_LETTER_REASON_HEADER]
    assert reason == f"handler_error: gave up after 2 attempts: {SECRET_DETAIL}"
    assert observer.seen == [("orders", "M3", reason)]
    # The payload may be quoted in an exception's text: the log line names its class only.
    assert "4111" not in caplog.text
    assert "gave up after 2 attempts: ValueError" in caplog.text
    assert broker.depth(QUEUE) == 0


def test_the_error_text_is_logged_when_asked_for(
    broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
):
    settler = Settler(POLICY, consumer="orders", log_error_text=True)
    broker.publish(QUEUE, b"not json", message_id="M4")
    with caplog.at_level(logging.WARNING, logger="idemq.worker"):
        settler.settle_many([(receive(broker), Verdict.INVALID_MESSAGE, SECRET_DETAIL)])
    assert "card 4111-1111 declined" in caplog.text


def test_a_refused_settlement_is_counted_and_logged_never_raised(
    broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
):
    settler = Settler(POLICY, consumer="orders")
    broker.publish(QUEUE, b"{}", message_id="M5")
    delivery = receive(broker)
    broker.close()  # the connection is gone: the ack cannot be sent
    with caplog.at_level(logging.ERROR, logger="idemq.worker"):
        assert settler.settle_many([(delivery, Verdict.PROCESSED, "")]) == [Verdict.PROCESSED]
    assert settler.stats.settle_failures == 1
    assert settler.stats.summary() == {"processed": 1, "settle_failures": 1}
    assert "settling 'M5' as Ack() failed" in caplog.text
    with pytest.raises(AlreadySettledError):
        delivery.ack()  # the broker redelivers it; this copy is settled for good


def test_empty_stats_read_idle():
    assert str(WorkerStats()) == "idle"
    assert WorkerStats().summary() == {}
