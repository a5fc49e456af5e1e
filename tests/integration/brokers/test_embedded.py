"""The broker contract on the embedded SQLite queue (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from idemq.brokers.embedded import EmbeddedBroker
from idemq.errors import AlreadySettledError

from .contract import BrokerContract


class TestEmbedded(BrokerContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self, tmp_path: Path) -> str:
        # A 1 s visibility timeout so a crashed consumer's message comes back quickly.
        return f"embedded://{tmp_path / 'queue.db'}?visibility_timeout_s=1"


def test_visibility_timeout_redelivers_with_attempt_count(tmp_path: Path) -> None:
    now = [1_000_000]
    broker = EmbeddedBroker(tmp_path / "q.db", visibility_timeout_s=5, clock_ms=lambda: now[0])
    broker.publish("q", b"{}", message_id="A")
    first = next(broker.consume("q"))
    assert first is not None
    assert first.message is not None
    assert first.delivery_attempt == 1
    assert next(broker.consume("q")) is None  # hidden while held
    now[0] += 5_000
    second = next(broker.consume("q"))  # the holder "crashed": visible again
    assert second is not None
    assert second.delivery_attempt == 2
    first.ack()  # stale receipt: ignored (logged), the row is still held by the second receipt
    assert broker.depth("q") == 1
    second.ack()
    assert broker.depth("q") == 0
    broker.close()


def test_retry_delay_and_dead_letter_are_atomic_moves(tmp_path: Path) -> None:
    now = [0]
    broker = EmbeddedBroker(tmp_path / "q.db", clock_ms=lambda: now[0])
    broker.publish("q", b"x", message_id="A")
    delivery = next(broker.consume("q"))
    assert delivery is not None
    delivery.retry(2.0)
    assert next(broker.consume("q")) is None
    now[0] += 2_000
    again = next(broker.consume("q"))
    assert again is not None
    again.dead_letter("invalid_message: test")
    assert broker.depth("q") == 0
    dead = next(broker.consume("q.dlq"))
    assert dead is not None
    assert dead.headers["idemq-dead-letter-reason"] == "invalid_message: test"
    assert dead.headers["idemq-original-queue"] == "q"
    assert dead.headers["idemq-delivery-attempts"] == "2"
    broker.close()


def test_settling_twice_raises(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path / "q.db")
    broker.publish("q", b"x", message_id="A")
    delivery = next(broker.consume("q"))
    assert delivery is not None
    delivery.ack()
    assert delivery.settled
    with pytest.raises(AlreadySettledError):
        delivery.retry(0)
    broker.close()
