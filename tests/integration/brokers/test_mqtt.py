"""The broker contract on MQTT v5 (Mosquitto): QoS 1, persistent sessions, manual PUBACK."""

from __future__ import annotations

import pytest

from tests.conftest import require_service
from tests.contract.brokers import BrokerContract

pytestmark = pytest.mark.mqtt


class TestMqtt(BrokerContract):
    redelivery_timeout_s = 10.0  # unacked QoS 1 messages are resent when the session reconnects

    @pytest.fixture
    def broker_url(self) -> str:
        require_service("mqtt")
        return "mqtt://127.0.0.1:1883"
