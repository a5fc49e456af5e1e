"""idemq.integrations.celery against a real Celery worker (in-process), Redis broker + backend.

Each test gets its own queue on Redis db 9 and its own dedup/business tables in a SQLite file;
effects are checked on business rows (the table has no unique constraint).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TimeoutError as CeleryTimeoutError

from idemq import Idempotency, PayloadMismatchError, SqlStore
from idemq.integrations.celery import current_tx, idempotent_task
from tests.conftest import require_service, unique

REDIS_DB_URL = "redis://127.0.0.1:6379/9"
RESULT_TIMEOUT_S = 20

pytestmark = [
    pytest.mark.redis,
    # Celery 5.x's Redis result backend still calls SETEX, which redis-py 8 deprecates.
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
]


class Env:
    def __init__(self, app: Celery, store: SqlStore, table: str) -> None:
        self.app = app
        self.store = store
        self.table = table
        self.calls = 0
        self.fail_next = 0

    def rows(self) -> list[str]:
        with self.store.engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text(f"SELECT order_id FROM {self.table}"))]

    def insert(self, tx: Any, order_id: str) -> None:
        tx.execute(sa.text(f"INSERT INTO {self.table} (order_id) VALUES (:o)"), {"o": order_id})


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    require_service("redis")
    queue = unique("celery")
    app = Celery(queue, broker=REDIS_DB_URL, backend=REDIS_DB_URL)
    app.conf.update(
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=300,
    )
    store = SqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    store.create_schema()
    table = unique("orders")
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (order_id VARCHAR(64))"))
    yield Env(app, store, table)
    store.drop_schema()
    store.close()
    client = redis.Redis.from_url(REDIS_DB_URL)
    try:
        client.delete(queue)  # the queue list; results expire on their own
    finally:
        client.close()


def test_same_key_twice_runs_the_body_once_and_replays_the_result(env: Env) -> None:
    guard = Idempotency(env.store, consumer=unique("pay"))

    @idempotent_task(env.app, guard, key="order_id", name=unique("pay"))
    def pay(order_id: str, amount: int, tx: Any = None) -> dict[str, Any]:
        assert tx is current_tx()
        env.calls += 1
        env.insert(tx, order_id)
        return {"paid": order_id, "amount": amount, "run": env.calls}

    with start_worker(env.app, pool="solo", perform_ping_check=False):
        first = pay.delay("order-1", 10).get(timeout=RESULT_TIMEOUT_S)
        second = pay.delay(order_id="order-1", amount=10).get(timeout=RESULT_TIMEOUT_S)
        other = pay.delay("order-2", 5).get(timeout=RESULT_TIMEOUT_S)

    assert first == second == {"paid": "order-1", "amount": 10, "run": 1}, "replayed, not rerun"
    assert other["run"] == 2
    assert sorted(env.rows()) == ["order-1", "order-2"]
    assert env.calls == 2


def test_keyed_by_task_id_by_default(env: Env) -> None:
    guard = Idempotency(env.store, consumer=unique("ship"))

    @idempotent_task(env.app, guard, name=unique("ship"))
    def ship(order_id: str, tx: Any = None) -> str:
        env.calls += 1
        env.insert(tx, order_id)
        return f"shipped {order_id}"

    task_id = unique("task")
    with start_worker(env.app, pool="solo", perform_ping_check=False):
        # The same task id twice: what a redelivery or a client re-send looks like.
        a = ship.apply_async(("order-7",), task_id=task_id).get(timeout=RESULT_TIMEOUT_S)
        b = ship.apply_async(("order-7",), task_id=task_id).get(timeout=RESULT_TIMEOUT_S)
        c = ship.delay("order-7").get(timeout=RESULT_TIMEOUT_S)  # a new task id: a new message

    assert a == b == c == "shipped order-7"
    assert env.rows() == ["order-7", "order-7"], "one effect per task id"
    assert guard.store.get(task_id, consumer=guard.consumer) is not None


def test_failing_body_propagates_and_rolls_back_then_a_retry_applies_once(env: Env) -> None:
    guard = Idempotency(env.store, consumer=unique("charge"))
    env.fail_next = 2

    @idempotent_task(
        env.app,
        guard,
        key="order_id",
        name=unique("charge"),
        autoretry_for=(RuntimeError,),
        retry_backoff=False,
        default_retry_delay=0.1,
        max_retries=5,
    )
    def charge(order_id: str, tx: Any = None) -> str:
        env.calls += 1
        env.insert(tx, order_id)  # rolled back when we raise below
        if env.fail_next > 0:
            env.fail_next -= 1
            raise RuntimeError("card processor timeout")
        return "charged"

    with start_worker(env.app, pool="solo", perform_ping_check=False):
        result = charge.delay("order-9").get(timeout=RESULT_TIMEOUT_S)
        again = charge.delay("order-9").get(timeout=RESULT_TIMEOUT_S)

    assert result == again == "charged"
    assert env.calls == 3, "two failures retried by Celery, then one success; the repeat replayed"
    assert env.rows() == ["order-9"]


def test_in_progress_retries_until_the_holder_finishes(env: Env) -> None:
    # Lease mode: a claim is visible while its handler runs, so a twin sees IN_PROGRESS.
    consumer = unique("lease")
    guard = Idempotency(env.store, consumer=consumer, mode="lease", lease_s=30)
    holder = Idempotency(env.store, consumer=consumer, mode="lease", lease_s=30)
    entered, release = threading.Event(), threading.Event()
    engine = env.store.engine

    def slow(_tx: Any) -> str:
        entered.set()
        release.wait(RESULT_TIMEOUT_S)
        with engine.begin() as conn:
            env.insert(conn, "order-5")
        return "done by the holder"

    @idempotent_task(
        env.app, guard, key="order_id", name=unique("book"), in_progress_countdown_s=0.2
    )
    def book(order_id: str) -> str:
        env.calls += 1
        return "done by the task"

    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(holder.process("order-5", slow)))
    thread.start()
    assert entered.wait(RESULT_TIMEOUT_S)
    try:
        with start_worker(env.app, pool="solo", perform_ping_check=False):
            pending = book.delay("order-5")
            # While the holder runs, the task can only be retried (never succeed, never run).
            with pytest.raises(CeleryTimeoutError):
                pending.get(timeout=1.0)
            release.set()
            result = pending.get(timeout=RESULT_TIMEOUT_S)
    finally:
        release.set()
        thread.join()

    assert result == "done by the holder", "the holder's stored result is replayed"
    assert env.calls == 0
    assert env.rows() == ["order-5"]


def test_the_same_key_with_other_arguments_is_refused_not_replayed(env: Env) -> None:
    # A key reused for another payment must not be answered with the first payment's result.
    guard = Idempotency(env.store, consumer=unique("pay"))

    @idempotent_task(env.app, guard, key="order_id", name=unique("pay"))
    def pay(order_id: str, amount: int, tx: Any = None) -> dict[str, Any]:
        env.calls += 1
        env.insert(tx, order_id)
        return {"paid": order_id, "amount": amount}

    with start_worker(env.app, pool="solo", perform_ping_check=False):
        first = pay.delay("order-9", 10).get(timeout=RESULT_TIMEOUT_S)
        with pytest.raises(PayloadMismatchError):
            pay.delay("order-9", 99).get(timeout=RESULT_TIMEOUT_S)

    assert first == {"paid": "order-9", "amount": 10}
    assert env.calls == 1
    assert env.rows() == ["order-9"]
