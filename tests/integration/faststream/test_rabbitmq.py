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


async def test_request_through_a_guarded_broker_replays_the_stored_reply(tmp_path: Any) -> None:
    """``broker.request()``: the reply is the handler's result; the same request again (same
    message id) is a duplicate, answered with the stored result, the handler not run again. The
    requester's own broker has the middleware too: the reply it receives is not guarded."""
    require_service("rabbitmq")
    store = AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}")
    await store.create_schema()
    name = unique("rpc")
    broker = RabbitBroker(
        URL,
        middlewares=[IdempotencyMiddleware(AsyncIdempotency(store, consumer=name))],
        log_level=30,
    )
    runs: list[int] = []

    @broker.subscriber(RabbitQueue(name, auto_delete=True))
    async def quote(body: dict[str, int]) -> dict[str, int]:
        runs.append(body["n"])
        return {"price": body["n"] * 10, "run": len(runs)}

    try:
        await broker.start()
        first = await broker.request({"n": 4}, queue=name, message_id="RPC-1", timeout=10)
        again = await broker.request({"n": 4}, queue=name, message_id="RPC-1", timeout=10)
        other = await broker.request({"n": 5}, queue=name, message_id="RPC-2", timeout=10)
        assert await first.decode() == await again.decode() == {"price": 40, "run": 1}
        assert await other.decode() == {"price": 50, "run": 2}
        assert runs == [4, 5]
    finally:
        await broker.stop()
        await store.close()


async def test_an_outage_does_not_bring_a_message_closer_to_the_dead_letters() -> None:
    """A quorum queue counts every redelivery (``x-delivery-count``); a store outage causes
    many. After the store comes back, one transient handler failure is retried and the message
    applied, with ``max_attempts=2``: the outage's redeliveries were not attempts."""
    from tests.conftest import PG_URL  # noqa: PLC0415
    from tests.contract._proxy import CuttableProxy  # noqa: PLC0415
    from tests.contract.faststream import FAST  # noqa: PLC0415

    require_service("rabbitmq")
    require_service("postgres")
    proxy = CuttableProxy(("127.0.0.1", 5432))
    url = PG_URL.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    store = AsyncSqlStore(url, table=unique("mi"))
    await store.create_schema()
    name = unique("outage")
    dead: list[str] = []

    async def on_dead_letter(msg: Any, reason: str, headers: dict[str, str]) -> None:
        dead.append(reason)

    middleware = IdempotencyMiddleware(
        AsyncIdempotency(store, consumer=name),
        max_attempts=2,
        retry_policy=FAST,
        on_dead_letter=on_dead_letter,
    )
    runs: list[int] = []
    seen: list[str] = []

    class Counting(BaseMiddleware):  # outside the guard: sees every delivery
        async def consume_scope(self, call_next: Any, msg: Any) -> Any:
            seen.append(str((msg.headers or {}).get("x-delivery-count", 0)))
            return await call_next(msg)

    broker = RabbitBroker(URL, middlewares=[Counting, middleware], log_level=50)

    @broker.subscriber(
        RabbitQueue(name, durable=True, arguments={"x-queue-type": "quorum"}),
        ack_policy=AckPolicy.REJECT_ON_ERROR,
    )
    async def pay(body: dict[str, int]) -> dict[str, int]:
        runs.append(body["n"])
        if len(runs) == 1:
            raise RuntimeError("a transient failure, once")
        return {"paid": body["n"]}

    try:
        await broker.start()
        proxy.cut()
        await broker.publish({"n": 7}, queue=name, message_id="PAY-7")
        for _ in range(400):  # the outage's redeliveries pile up on the broker's count
            if len(seen) >= 8:
                break
            await asyncio.sleep(0.05)
        proxy.restore()
        for _ in range(400):
            if await store.get("PAY-7", consumer=name) is not None:
                break
            await asyncio.sleep(0.05)
        record = await store.get("PAY-7", consumer=name)
        assert record is not None, (seen, runs, dead)
        assert record.result == '{"paid":7}'
        assert runs == [7, 7], "one failure, then applied once"
        assert dead == []
        assert max(int(c) for c in seen) >= 6, seen
    finally:
        await broker.stop()
        proxy.restore()
        await store.drop_schema()
        await store.close()
        proxy.close()
        from idemq.brokers import open_broker  # noqa: PLC0415

        admin = open_broker(URL)
        admin.delete_queue(name)
        admin.close()
