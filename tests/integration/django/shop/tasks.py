"""Celery tasks of the test project (the broker is RabbitMQ; the queue is per test run)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery

from idemq.integrations.django import idempotent
from tests.integration.django.shop.models import Payment

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_default_queue=os.environ.get("IDEMQ_DJ_QUEUE", "shop"),
    result_backend="rpc://",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(acks_late=True, name="shop.pay")
@idempotent(consumer="shop.pay", key="order_id")
def pay(order_id: str, amount: int) -> dict[str, object]:
    payment = Payment.objects.create(order_id=order_id, amount=amount)
    return {"paid": order_id, "payment": payment.pk}


@app.task(acks_late=True, name="shop.ship")
@idempotent(consumer="shop.ship")
def ship(order_id: str) -> str:
    """Keyed by the task id: a redelivery (same id) is a duplicate, a new task is not."""
    Payment.objects.create(order_id=order_id, amount=0)
    return f"shipped {order_id}"


@app.task(acks_late=True, name="shop.hold")
@idempotent(consumer="shop.hold", key="order_id", mode="lease", in_progress_countdown_s=0.2)
def hold(order_id: str, started: str, gate: str) -> dict[str, str]:
    """Holds its lease until the test opens ``gate``: a twin meanwhile finds it in progress."""
    Path(started).touch()
    deadline = time.monotonic() + 60
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the gate never opened")
        time.sleep(0.01)
    Payment.objects.create(order_id=order_id, amount=1)
    return {"held": order_id}
