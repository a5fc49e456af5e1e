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
        relay = idemq.OutboxRelay(sync_outbox, amqp)
        relay.run_once()
        relay.close()
        stream = receiver.consume(ship, prefetch=10)
        got = []
        for _ in range(20):
            delivery = next(stream)
            if delivery is not None:
                got.append((delivery.message.id if delivery.message else None, delivery.body))
                delivery.ack()
            elif got:
                break
        stream.close()
        assert [(i, json.loads(b)) for i, b in got] == [(ids[0], {"ship": "o1"})]
    finally:
        await broker.stop()
        receiver.delete_queue(ship)
        receiver.close()
        sync_outbox.drop_schema()
        sync_store.close()
        await store.drop_schema()
        await store.close()
