"""The outbox inside the integrations: a Celery task adds in its dedup transaction; a FastStream
handler's publishes go into the outbox in its dedup transaction."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import sqlalchemy as sa
from celery.contrib.testing.worker import start_worker

import idemq
from idemq.integrations.celery import idempotent_task
from idemq.outbox.ids import derived_id
from tests.conftest import unique
from tests.integration.test_celery import RESULT_TIMEOUT_S, Env, env  # noqa: F401 - fixture

pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
]


def test_celery_task_adds_to_the_outbox_in_its_dedup_transaction(env: Env) -> None:  # noqa: F811
    outbox = idemq.Outbox(env.store, table=unique("ob"))
    outbox.create_schema()
    consumer = unique("pay")
    guard = idemq.Idempotency(env.store, consumer=consumer)

    @idempotent_task(env.app, guard, key="order_id", name=unique("pay"))
    def pay(order_id: str, tx: Any = None) -> str:
        env.insert(tx, order_id)
        return outbox.add(tx, "shipments", f"ship {order_id}".encode(), ordering_key=order_id)

    try:
        with start_worker(env.app, pool="solo", perform_ping_check=False):
            first = pay.delay("order-1").get(timeout=RESULT_TIMEOUT_S)
            again = pay.delay(order_id="order-1").get(timeout=RESULT_TIMEOUT_S)
        assert first == again == derived_id(consumer, "order-1", 0)
        with env.store.engine.connect() as conn:
            ids = [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {outbox.table}"))]
        assert ids == [first]
        assert env.rows() == ["order-1"]
    finally:
        outbox.drop_schema()


async def test_faststream_handler_publishes_go_through_the_outbox() -> None:
    from faststream.rabbit import RabbitBroker, RabbitQueue  # noqa: PLC0415

    from idemq.brokers import open_broker  # noqa: PLC0415
    from idemq.integrations.faststream import IdempotencyMiddleware  # noqa: PLC0415
    from tests.conftest import PG_URL, require_service  # noqa: PLC0415
    from tests.contract.faststream import FAST  # noqa: PLC0415

    require_service("rabbitmq")
    require_service("postgres")
    amqp = "amqp://guest:guest@127.0.0.1:5672/"
    pay, ship = unique("pay"), unique("ship")
    store = idemq.AsyncSqlStore(PG_URL, table=unique("mi"))
    await store.create_schema()
    outbox = idemq.AsyncOutbox(store, table=unique("ob"))
    await outbox.create_schema()
    guard = idemq.AsyncIdempotency(store, consumer=pay)
    broker = RabbitBroker(
        amqp,
        middlewares=[IdempotencyMiddleware(guard, outbox=outbox, retry_policy=FAST)],
        log_level=30,
    )
    runs: list[str] = []

    @broker.subscriber(RabbitQueue(pay, auto_delete=True))
    async def handle(body: dict[str, Any]) -> None:
        await broker.publish({"ship": body["order"]}, queue=ship)
        runs.append(body["order"])
        if len(runs) == 1:
            raise RuntimeError("crash after publishing, before commit")

    sync_store = idemq.SqlStore(PG_URL)
    sync_outbox = idemq.Outbox(sync_store, table=outbox.table)
    receiver = open_broker(amqp)
    try:
        receiver.declare(ship)
        await broker.start()
        await broker.publish({"order": "o1"}, queue=pay, message_id="PAY-o1")
        for _ in range(200):
            if len(runs) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        with sync_store.engine.connect() as conn:
            ids = [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {outbox.table}"))]
        assert runs == ["o1", "o1"]
        assert ids == [derived_id(pay, "PAY-o1", 0)], "the failed run's publish rolled back"
        got = _relay_then_receive(sync_outbox, amqp, receiver, ship)
        assert [(i, json.loads(b)) for i, b in got] == [(ids[0], {"ship": "o1"})]
    finally:
        await broker.stop()
        receiver.delete_queue(ship)
        receiver.close()
        sync_outbox.drop_schema()
        sync_store.close()
        await store.drop_schema()
        await store.close()


def _relay_then_receive(
    outbox: idemq.Outbox, amqp: str, receiver: Any, queue: str
) -> list[tuple[str | None, bytes]]:
    """One relay pass over ``outbox``, then the (id, body) of what reached ``queue``."""
    relay = idemq.OutboxRelay(outbox, amqp)
    relay.run_once()
    relay.close()
    stream = receiver.consume(queue, prefetch=10)
    got = []
    for _ in range(20):
        delivery = next(stream)
        if delivery is not None:
            got.append((delivery.message.id if delivery.message else None, delivery.body))
            delivery.ack()
        elif got:
            break
    stream.close()
    return got


class _FailingOnce(idemq.AsyncOutbox):
    """The outbox, whose first add under a caller's id fails as if the process had died just
    after the handler's commit (the output not yet in the outbox, the delivery not acked)."""

    failed = False

    async def add(self, conn_or_session: Any, destination: str, body: bytes, **kw: Any) -> str:
        if kw.get("message_id") is not None and not self.failed:
            self.failed = True
            raise idemq.StoreUnavailableError("injected: died before the output was added")
        return await super().add(conn_or_session, destination, body, **kw)


async def test_faststream_publisher_output_goes_through_the_outbox_once() -> None:
    """A ``@publisher``'s output: into the outbox after the commit, under an id derived from
    the incoming message; the delivery is acked only then. The first try to add it fails: the
    delivery comes back, the guard answers DUPLICATE, the replayed result is the same output
    under the same id. A producer's retry of the message adds nothing either. One effect, one
    row, one shipment downstream."""
    from faststream.rabbit import RabbitBroker, RabbitQueue  # noqa: PLC0415

    from idemq.brokers import open_broker  # noqa: PLC0415
    from idemq.integrations.faststream import IdempotencyMiddleware  # noqa: PLC0415
    from tests.conftest import PG_URL, require_service  # noqa: PLC0415
    from tests.contract.faststream import FAST  # noqa: PLC0415

    require_service("rabbitmq")
    require_service("postgres")
    amqp = "amqp://guest:guest@127.0.0.1:5672/"
    pay, ship = unique("pay"), unique("ship")
    store = idemq.AsyncSqlStore(PG_URL, table=unique("mi"))
    await store.create_schema()
    outbox = _FailingOnce(store, table=unique("ob"))
    await outbox.create_schema()
    guard = idemq.AsyncIdempotency(store, consumer=pay)
    broker = RabbitBroker(
        amqp,
        middlewares=[IdempotencyMiddleware(guard, outbox=outbox, retry_policy=FAST)],
        log_level=50,
    )
    runs: list[str] = []

    @broker.subscriber(RabbitQueue(pay, auto_delete=True))
    @broker.publisher(ship)
    async def handle(body: dict[str, Any]) -> dict[str, str]:
        runs.append(body["order"])
        return {"ship": body["order"]}

    sync_store = idemq.SqlStore(PG_URL)
    sync_outbox = idemq.Outbox(sync_store, table=outbox.table)
    receiver = open_broker(amqp)
    expected_id = derived_id(pay, "PAY-o1", "output-0")

    def outbox_ids() -> list[str]:
        with sync_store.engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {outbox.table}"))]

    try:
        receiver.declare(ship)
        await broker.start()
        await broker.publish({"order": "o1"}, queue=pay, message_id="PAY-o1")
        for _ in range(400):
            if outbox_ids():
                break
            await asyncio.sleep(0.05)
        await broker.publish({"order": "o1"}, queue=pay, message_id="PAY-o1")  # a retry
        await asyncio.sleep(1.0)
        assert outbox.failed, "the first add was refused"
        assert runs == ["o1"], "the handler ran once: the redelivery was a DUPLICATE"
        assert outbox_ids() == [expected_id]
        got = _relay_then_receive(sync_outbox, amqp, receiver, ship)
        assert [(i, json.loads(b)) for i, b in got] == [(expected_id, {"ship": "o1"})]
    finally:
        await broker.stop()
        receiver.delete_queue(ship)
        receiver.close()
        sync_outbox.drop_schema()
        sync_store.close()
        await store.drop_schema()
        await store.close()
