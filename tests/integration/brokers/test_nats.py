"""The broker contract on NATS JetStream (pull consumer, AckWait, NAK delay, TERM)."""

from __future__ import annotations

import pytest

from tests.conftest import require_service

from .contract import BrokerContract

pytestmark = pytest.mark.nats


class TestNats(BrokerContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("nats")
        # AckWait of 1 s: a dead consumer's message is redelivered a second later.
        return "nats://127.0.0.1:4222?ack_wait_s=1"
