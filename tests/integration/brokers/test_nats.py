"""The broker contract on NATS JetStream (pull consumer, AckWait, NAK delay, TERM), acks queued
to the loop thread."""

from __future__ import annotations

import time
from typing import Any

import pytest

from idemq.brokers import open_broker
from idemq.brokers.base import Broker, Delivery
from idemq.brokers.nats import stream_name
from idemq.message import MESSAGE_ID_HEADER
from tests.conftest import require_service, unique
from tests.contract.brokers import dead_letter_refused_comes_back
from tests.contract.brokers_queued_acks import QueuedAckContract

pytestmark = pytest.mark.nats


class TestNats(QueuedAckContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("nats")
        # AckWait of 1 s: a dead consumer's message is redelivered a second later.
        return "nats://127.0.0.1:4222?ack_wait_s=1"

    def publish_duplicate(
        self,
        publisher: Broker,
        queue: str,
        body: bytes,
        message_id: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Not through publish(message_id=…): its Nats-Msg-Id would let JetStream's own dedup
        # window drop the copy, and idemq's dedup would never see it. The id in the idemq
        # header alone is what a producer retrying without Nats-Msg-Id (or after the window) sends.
        publisher.publish(queue, body, headers={**(headers or {}), MESSAGE_ID_HEADER: message_id})

    def break_connection(self, broker: Any, delivery: Delivery) -> None:
        # Close the connection: acks cannot be sent; JetStream redelivers after AckWait.
        broker.settle(broker._nc.close())


def test_idle_pulls_after_delayed_naks_are_idle_not_an_outage() -> None:
    # nats-py's fetch of several messages can end in a plain asyncio TimeoutError (not its own
    # nats.errors.TimeoutError) once messages were NAKed with a delay; the adapter read that as
    # "broker call timed out after 15 s", and the worker dropped its connection to reconnect.
    require_service("nats")
    url = "nats://127.0.0.1:4222?ack_wait_s=1"
    queue = unique("q")
    publisher = open_broker(url)
    publisher.declare(queue)
    consumer = open_broker(url)
    try:
        publisher.publish(queue, b"{}", message_id="A")
        seen: list[int] = []
        deadline = time.monotonic() + 4
        for delivery in consumer.consume(queue, prefetch=10):
            if delivery is not None:
                seen.append(delivery.delivery_attempt)
                if len(seen) < 3:  # a failed run (counted), then an outage (not counted)
                    delivery.retry(0.3, counted=len(seen) == 1)
                else:
                    delivery.ack()
            if time.monotonic() > deadline:
                break
        assert seen == [1, 2, 2]
    finally:
        consumer.close()
        publisher.delete_queue(queue)
        publisher.close()


def test_a_dead_letter_no_stream_captures_comes_back_to_its_queue() -> None:
    # The dead-letter stream is deleted while the consumer runs: the copy is refused, so the
    # original must not be TERMed (lost from both places) but come back to be tried again.
    require_service("nats")
    url = "nats://127.0.0.1:4222?ack_wait_s=30"
    queue = unique("q")
    consumer = open_broker(url)
    admin: Any = open_broker(url)
    try:
        dead_letter_refused_comes_back(
            consumer,
            admin,
            queue,
            lambda: admin.settle(admin._js.delete_stream(stream_name(f"{queue}.dlq"))),
        )
    finally:
        consumer.close()
        admin.delete_queue(queue)
        admin.close()
