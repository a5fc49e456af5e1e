"""The broker contract on RabbitMQ (quorum queues, DLX), acks queued to the loop thread."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from idemq.brokers import open_broker
from idemq.brokers.base import DEAD_LETTER_REASON_HEADER, Broker, Delivery
from idemq.brokers.rabbitmq import RabbitMQBroker
from idemq.brokers.settlement import Verdict
from idemq.message import MESSAGE_ID_HEADER
from idemq.worker.loop import Worker
from tests.conftest import require_service, unique
from tests.contract.brokers import (
    FAST,
    Business,
    Running,
    dead_letter_refused_comes_back,
    first_delivery,
    wait_for,
)
from tests.contract.brokers_queued_acks import QueuedAckContract

pytestmark = pytest.mark.rabbitmq


class TestRabbitMQ(QueuedAckContract):
    redelivery_timeout_s = 10.0  # a dropped connection requeues at once
    # aiormq stamps a random message_id on every publish that lacks one.
    can_publish_without_id = False
    outage_s = 10.0  # the outage of issue 24: ~10 s of store outage, then one handler failure

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("rabbitmq")
        return "amqp://guest:guest@127.0.0.1:5672/"

    def break_connection(self, broker: Any, delivery: Delivery) -> None:
        # Close the consumer channel: RabbitMQ requeues its unacked messages, acks then fail.
        broker.settle(delivery._message.channel.close())  # type: ignore[attr-defined]

    def test_ids_too_long_for_amqp_are_dead_lettered_and_the_queue_goes_on(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        # AMQP's message-id property holds at most 255 bytes. A 10 KB id in the idemq header
        # (invalid: over 128 characters) and a legal 100-emoji id (400 bytes) whose payload
        # differs from its first copy's must both be dead-lettered, with prefetch 1, so the
        # messages behind them are applied: a delivery that fails to dead-letter would hold
        # the only prefetch slot for good.
        emoji = "\U0001f600" * 100
        good = [f"G{i}_{queue}" for i in range(3)]
        worker = Worker(
            business.handler,
            open_broker(broker_url),
            self.guard(business.url, unique("c")),
            queue,
            prefetch=1,
            policy=FAST,
        )
        running = Running(worker)
        publisher.publish(queue, b'{"n": 1}', headers={MESSAGE_ID_HEADER: "H" * 10_000})
        publisher.publish(queue, b'{"n": 2}', message_id=emoji)
        publisher.publish(queue, b'{"n": 3}', message_id=emoji)  # same id, another payload
        for message_id in good:
            publisher.publish(queue, b'{"n": 4}', message_id=message_id)
        wait_for(lambda: set(good) <= set(business.counts()), 30, "the messages behind them")
        dead = self.read_dead_letters(broker_url, queue, expected=2)
        running.stop()
        reasons = sorted(headers.get(DEAD_LETTER_REASON_HEADER, "") for _, headers in dead)
        assert len(reasons) == 2, reasons
        assert reasons[0].startswith("invalid_message: InvalidMessageIdError"), reasons
        assert reasons[1].startswith("payload_mismatch"), reasons
        for _, headers in dead:  # the original id is kept, in the header
            assert headers[MESSAGE_ID_HEADER] in ("H" * 10_000, emoji)
        assert business.counts() == Counter({emoji: 1, **{m: 1 for m in good}})

    def test_an_id_header_that_is_not_utf8_is_dead_lettered_with_its_bytes_kept(
        self, broker_url: str, queue: str, business: Business, publisher: Broker
    ) -> None:
        # AMQP headers can carry raw bytes. An id that is not UTF-8 used to become the text
        # "bytearray(b'...')" — and a valid UTF-8 id sent as bytes did too. Now: valid UTF-8
        # bytes are decoded (the effect is keyed by the real id), invalid ones dead-letter the
        # message as an invalid id, with the original headers, bytes and types kept.
        good = f"caf\u00e9_{queue}"
        worker = Worker(
            business.handler,
            open_broker(broker_url),
            self.guard(business.url, unique("c")),
            queue,
            prefetch=1,
            policy=FAST,
        )
        running = Running(worker)
        raw_headers: dict[str, Any] = {  # bytearray: an AMQP byte array (pamqp's binary type)
            MESSAGE_ID_HEADER: bytearray(b"\xffnot-utf8"),
            "x-signature": bytearray(b"\x00\xfe\x01"),
            "x-count": 7,
        }
        publisher.publish(queue, b'{"n": 1}', headers=raw_headers)
        publisher.publish(queue, b'{"n": 2}', headers={MESSAGE_ID_HEADER: bytearray(good.encode())})
        wait_for(lambda: good in business.counts(), 30, "the message behind it, by its real id")
        broker = open_broker(broker_url)
        try:
            dead = first_delivery(broker.consume(broker.dead_letter_queue(queue)), timeout_s=20)
            original = dict(dead._message.header.properties.headers or {})  # type: ignore[attr-defined]
            dead.ack()
        finally:
            broker.close()
        running.stop()
        assert business.counts() == Counter({good: 1})
        assert dead.body == b'{"n": 1}'
        reason = dead.headers[DEAD_LETTER_REASON_HEADER]
        assert (
            reason == "invalid_message: InvalidMessageIdError: idemq-message-id is not valid UTF-8"
        )
        assert bytes(original[MESSAGE_ID_HEADER]) == b"\xffnot-utf8"
        assert bytes(original["x-signature"]) == b"\x00\xfe\x01"
        assert original["x-count"] == 7
        assert worker.stats.verdicts[Verdict.INVALID_MESSAGE] == 1


def test_a_dead_letter_no_queue_takes_leaves_the_original_in_its_queue() -> None:
    # The dead-letter queue is deleted while the consumer runs. The copy must be published
    # mandatory: otherwise RabbitMQ confirms a message it routed nowhere, the original is acked,
    # and the poison message is gone from both queues.
    require_service("rabbitmq")
    url = "amqp://guest:guest@127.0.0.1:5672/"
    queue = unique("q")
    consumer = RabbitMQBroker(url)
    admin = RabbitMQBroker(url, dead_letter=f"{queue}.dlq")
    try:
        # An operator removes the dead-letter queue (admin's dead letters are <queue>.dlq's).
        dead_letter_refused_comes_back(
            consumer, admin, queue, lambda: admin.delete_queue(f"{queue}.dlq")
        )
    finally:
        consumer.close()
        admin.delete_queue(queue)
        admin.close()
