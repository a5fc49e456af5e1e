"""IdempotencyMiddleware on MQTT 5 (Mosquitto, through FastStream's zmqtt client), live.

MQTT has no nack: an unacknowledged QoS 1 message only comes back after a reconnect. So the
middleware retries failed/IN_PROGRESS messages *in place* (same delivery, after the backoff) and
dead-letters by acknowledging. The id travels as an MQTT 5 user property (``idemq-message-id``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import CI, require_service

try:
    from faststream.mqtt import MQTTBroker, QoS
except ImportError as exc:  # faststream[mqtt] needs zmqtt, which this virtualenv may lack
    if CI:
        raise
    pytest.skip(f"faststream.mqtt is unusable: {str(exc).strip()}", allow_module_level=True)

from tests.contract.faststream import Apply, FastStreamContract, as_handler, id_headers

URL = "mqtt://127.0.0.1:1883"

pytestmark = pytest.mark.mqtt


class TestMQTT(FastStreamContract):
    retries_in_place = True

    @pytest.fixture(autouse=True)
    def _mqtt(self) -> None:
        require_service("mqtt")

    def make_broker(self, middlewares: list[Any]) -> Any:
        return MQTTBroker(URL, middlewares=middlewares, log_level=30)

    def subscribe(self, broker: Any, name: str, apply: Apply) -> None:
        broker.subscriber(f"idemq/{name}", qos=QoS.AT_LEAST_ONCE)(as_handler(apply))

    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        await broker.publish(
            body, f"idemq/{name}", qos=QoS.AT_LEAST_ONCE, headers=id_headers(message_id)
        )
