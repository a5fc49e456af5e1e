"""IdempotencyMiddleware on RabbitMQ (aio-pika through FastStream), live."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from faststream import AckPolicy, BaseMiddleware
from faststream.rabbit import RabbitBroker, RabbitQueue, TestRabbitBroker

from idemq import AsyncIdempotency, AsyncSqlStore, ConfigurationError
from idemq.integrations.faststream import IdempotencyMiddleware
from tests.conftest import require_service, unique
from tests.contract.faststream import Apply, FastStreamContract, as_handler

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


async def test_reject_routes_a_poison_message_to_the_queues_dead_letter_exchange(
    tmp_path: Any,
) -> None:
    """Without an on_dead_letter hook a dead message is rejected (requeue=False), so RabbitMQ
    moves it to the queue's DLX — here the default exchange, routing to ``<queue>.dlq``."""
    require_service("rabbitmq")
    store = AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    await store.create_schema()
    name = unique("idemq")
    queue = RabbitQueue(
        name,
        auto_delete=True,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{name}.dlq"},
    )
    ran: list[Any] = []
    guard = AsyncIdempotency(store, consumer=name)
    broker = RabbitBroker(
        URL, middlewares=[IdempotencyMiddleware(guard, key=lambda b: b["id"])], log_level=30
    )

    @broker.subscriber(queue)
    async def handle(body: Any) -> None:
        ran.append(body)

    try:
        await broker.start()
        dlq = await broker.declare_queue(RabbitQueue(f"{name}.dlq", auto_delete=False))
        await broker.publish(b"\xffnot json", queue=name)
        await broker.publish({"id": "fine"}, queue=name)
        dead = None
        for _ in range(100):
            dead = await dlq.get(no_ack=True, fail=False)
            if dead is not None:
                break
            await asyncio.sleep(0.05)
        assert dead is not None, "the poison message reached the dead-letter queue"
        assert dead.body == b"\xffnot json"
        for _ in range(100):
            if ran:
                break
            await asyncio.sleep(0.05)
        assert ran == [{"id": "fine"}]
        await dlq.delete(if_unused=False, if_empty=False)
    finally:
        await broker.stop()
        await store.drop_schema()
        await store.close()


async def test_ack_first_subscriber_is_refused(tmp_path: Any) -> None:
    """ACK_FIRST acks before the effect commits; the middleware refuses to run behind it."""
    require_service("rabbitmq")
    store = AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    await store.create_schema()
    name = unique("idemq")
    ran: list[Any] = []
    errors: list[BaseException] = []

    class Catch(BaseMiddleware):
        async def consume_scope(self, call_next: Any, msg: Any) -> Any:
            try:
                return await call_next(msg)
            except Exception as exc:
                errors.append(exc)
                raise

    guard = AsyncIdempotency(store, consumer=name)
    broker = RabbitBroker(URL, middlewares=[Catch, IdempotencyMiddleware(guard)], log_level=50)

    @broker.subscriber(RabbitQueue(name, auto_delete=True), ack_policy=AckPolicy.ACK_FIRST)
    async def handle(body: Any) -> None:
        ran.append(body)

    try:
        await broker.start()
        await broker.publish({"x": 1}, queue=name, message_id="m-1")
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.05)
    finally:
        await broker.stop()
    assert [type(e) for e in errors] == [ConfigurationError]
    assert ran == []
    assert await store.get("m-1", consumer=name) is None
    await store.drop_schema()
    await store.close()


async def test_smoke_with_faststream_test_broker(tmp_path: Any) -> None:
    """FastStream's in-memory TestRabbitBroker runs the middleware too (an addition to the live
    tests above, not a replacement): the second publish with the same id does not run the body."""
    store = AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    await store.create_schema()
    guard = AsyncIdempotency(store, consumer="smoke")
    broker = RabbitBroker(URL, middlewares=[IdempotencyMiddleware(guard)])
    ran: list[Any] = []

    @broker.subscriber("smoke-orders")
    async def handle(body: Any) -> dict[str, Any]:
        ran.append(body)
        return {"ok": body["n"]}

    async with TestRabbitBroker(broker) as test_broker:
        await test_broker.publish({"n": 1}, queue="smoke-orders", message_id="s-1")
        await test_broker.publish({"n": 1}, queue="smoke-orders", message_id="s-1")
    assert ran == [{"n": 1}]
    record = await store.get("s-1", consumer="smoke")
    assert record is not None
    assert record.result == '{"ok":1}'
    await store.drop_schema()
    await store.close()
