"""idemq.publish: ids stamped once, retries after a lost confirm reuse them, brokers dedup."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from idemq.brokers import open_broker
from idemq.brokers.embedded import EmbeddedBroker
from idemq.brokers.publish import Publisher, default_node, publish
from idemq.errors import BrokerUnavailableError
from idemq.ids.format import parse_message_id
from tests.conftest import require_service, unique


class LostConfirm(EmbeddedBroker):
    """A real embedded queue whose first ``lose`` publishes land but report a timeout —
    the network partition of DESIGN.md cause 1, injected at the confirm."""

    lose = 1

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        super().publish(queue, body, headers=headers, message_id=message_id)
        if self.lose:
            self.lose -= 1
            raise BrokerUnavailableError("confirm timed out")


def drain(broker: EmbeddedBroker, queue: str) -> list[str]:
    ids = []
    for delivery in broker.consume(queue):
        if delivery is None:
            break
        assert delivery.message is not None
        ids.append(delivery.message.id)
        delivery.ack()
    return ids


def test_publish_stamps_a_parseable_id_and_business_id(tmp_path: Path) -> None:
    url = f"embedded://{tmp_path / 'q.db'}"
    message_id = publish(url, "orders", b"{}", business_id="order_1", prefix="ORDER")
    parts = parse_message_id(message_id)
    assert parts.prefix == "ORDER"
    broker = EmbeddedBroker(tmp_path / "q.db")
    delivery = next(broker.consume("orders"))
    assert delivery is not None
    assert delivery.message is not None
    assert (delivery.message.id, delivery.message.business_id) == (message_id, "order_1")
    broker.close()


def test_retry_after_lost_confirm_reuses_the_id(tmp_path: Path) -> None:
    broker = LostConfirm(tmp_path / "q.db")
    slept: list[float] = []
    with Publisher(broker, attempts=3, sleep=slept.append) as publisher:
        message_id = publisher.publish("q", b"{}")
    assert slept == [0.5]
    assert drain(broker, "q") == [message_id, message_id]  # a duplicate, same id: the guard's job
    broker.close()


def test_gives_up_after_attempts(tmp_path: Path) -> None:
    broker = LostConfirm(tmp_path / "q.db")
    broker.lose = 5
    with pytest.raises(BrokerUnavailableError):
        Publisher(broker, attempts=2, sleep=lambda _s: None).publish("q", b"{}")
    broker.close()


def test_default_node_is_a_valid_id_part_and_differs_per_process() -> None:
    node = default_node()
    assert "_" not in node
    assert node.endswith(f"-P{os.getpid()}")


@pytest.fixture
def nats_queue() -> Iterator[str]:
    require_service("nats")
    queue = unique("pub")
    broker = open_broker("nats://127.0.0.1:4222")
    broker.declare(queue)
    yield queue
    broker.delete_queue(queue)
    broker.close()


@pytest.mark.nats
def test_nats_drops_the_retried_copy_server_side(nats_queue: str) -> None:
    url = "nats://127.0.0.1:4222"
    publish(url, nats_queue, b"{}", message_id="DUP-1")
    publish(url, nats_queue, b"{}", message_id="DUP-1")  # the producer retry
    publish(url, nats_queue, b"{}", message_id="OTHER-1")
    broker = open_broker(url)
    seen = []
    for delivery in broker.consume(nats_queue, prefetch=10):
        if delivery is None:
            break
        assert delivery.message is not None
        seen.append(delivery.message.id)
        delivery.ack()
    broker.close()
    assert seen == ["DUP-1", "OTHER-1"]
