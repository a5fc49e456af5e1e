"""The broker contract on RabbitMQ (quorum queues, DLX)."""

from __future__ import annotations

import pytest

from tests.conftest import require_service

from .contract import BrokerContract

pytestmark = pytest.mark.rabbitmq


class TestRabbitMQ(BrokerContract):
    redelivery_timeout_s = 10.0  # a dropped connection requeues at once
    # aiormq stamps a random message_id on every publish that lacks one.
    can_publish_without_id = False

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("rabbitmq")
        return "amqp://guest:guest@127.0.0.1:5672/"
