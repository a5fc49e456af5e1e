"""The broker contract on RabbitMQ (quorum queues, DLX), acks queued to the loop thread."""

from __future__ import annotations

from typing import Any

import pytest

from idemq.brokers.base import Delivery
from tests.conftest import require_service
from tests.contract.brokers_queued_acks import QueuedAckContract

pytestmark = pytest.mark.rabbitmq


class TestRabbitMQ(QueuedAckContract):
    redelivery_timeout_s = 10.0  # a dropped connection requeues at once
    # aiormq stamps a random message_id on every publish that lacks one.
    can_publish_without_id = False

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("rabbitmq")
        return "amqp://guest:guest@127.0.0.1:5672/"

    def break_connection(self, broker: Any, delivery: Delivery) -> None:
        # Close the consumer channel: RabbitMQ requeues its unacked messages, acks then fail.
        broker.settle(delivery._message.channel.close())  # type: ignore[attr-defined]
