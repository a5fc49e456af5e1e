"""The broker contract on NATS JetStream (pull consumer, AckWait, NAK delay, TERM), acks queued
to the loop thread."""

from __future__ import annotations

from typing import Any

import pytest

from idemq.brokers.base import Delivery
from tests.conftest import require_service
from tests.contract.brokers_queued_acks import QueuedAckContract

pytestmark = pytest.mark.nats


class TestNats(QueuedAckContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("nats")
        # AckWait of 1 s: a dead consumer's message is redelivered a second later.
        return "nats://127.0.0.1:4222?ack_wait_s=1"

    def break_connection(self, broker: Any, delivery: Delivery) -> None:
        # Close the connection: acks cannot be sent; JetStream redelivers after AckWait.
        broker.settle(broker._nc.close())
