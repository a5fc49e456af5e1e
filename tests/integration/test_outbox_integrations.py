"""The outbox inside the integrations: a Celery task adds in its dedup transaction."""

from __future__ import annotations

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
