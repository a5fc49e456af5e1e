"""IdempotencyMiddleware on RabbitMQ (aio-pika through FastStream), live."""

from __future__ import annotations

from typing import Any

import pytest
from faststream.rabbit import RabbitBroker, RabbitQueue

from tests.conftest import require_service

from .contract import Apply, FastStreamContract, as_handler

URL = "amqp://guest:guest@127.0.0.1:5672/"

pytestmark = pytest.mark.rabbitmq


class TestRabbitMQ(FastStreamContract):
    db_backend = "postgres"  # the other brokers use SQLite; both run the same transaction code
    # aiormq stamps a random AMQP message_id on every publish that has none, so with aio-pika
    # (FastStream's client) a message cannot arrive without an id — a producer that does not set
    # message_id gets a fresh random one per retry, which defeats deduplication.
    can_publish_without_id = False

    @pytest.fixture(autouse=True)
    def _rabbit(self) -> None:
        require_service("rabbitmq")

    def make_broker(self, middlewares: list[Any]) -> Any:
        return RabbitBroker(URL, middlewares=middlewares, log_level=30)

    def subscribe(self, broker: Any, name: str, apply: Apply) -> None:
        broker.subscriber(RabbitQueue(name, auto_delete=True))(as_handler(apply))

    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        await broker.publish(body, queue=name, message_id=message_id)
