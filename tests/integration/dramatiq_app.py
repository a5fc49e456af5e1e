"""A Dramatiq app guarded by idemq, built from a JSON config: in the test process or a worker.

``python -m tests.integration.dramatiq_app`` runs a ``dramatiq.Worker`` on the app described by
the ``IDEMQ_DRAMATIQ_CONFIG`` environment variable until SIGTERM (graceful stop) or SIGKILL.
With ``crash_at``, the process SIGKILLs itself in ``before_ack`` of the n-th ack counted
across all runs (a Redis counter): after the effect committed and the dedup row says done, before
the broker heard of it — the window where a redelivery must not apply the effect again.

Effects go to a business table on PostgreSQL with no unique constraint, so a double effect shows
as two rows. SQL store: the actor writes through ``tx`` (transactional); Redis store: the actor
writes through its own connection (lease mode, the effect outside the dedup store).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import dramatiq
import redis
import sqlalchemy as sa
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from idemq import Idempotency, RedisStore, SqlStore
from idemq.brokers.settlement import RetryPolicy
from idemq.integrations.dramatiq import IdempotencyMiddleware, current_tx

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672"
REDIS_URL = "redis://127.0.0.1:6379/0"
PG_URL = os.environ.get("IDEMQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
CONFIG_ENV = "IDEMQ_DRAMATIQ_CONFIG"
# Dramatiq's Retries backoff for the actor that fails once (milliseconds, Dramatiq's unit).
MIN_BACKOFF_MS = 50
MAX_BACKOFF_MS = 200


@dataclass
class App:
    """Everything a test touches: the broker, the guarded actors, the business table."""

    config: dict[str, Any]
    broker: dramatiq.Broker
    engine: sa.Engine
    redis: redis.Redis
    results: RedisBackend
    pay: dramatiq.Actor[Any, Any]
    guard: Idempotency

    @property
    def queue(self) -> str:
        return str(self.config["queue"])

    def rows(self) -> dict[str, int]:
        """Business rows per order id."""
        with self.engine.connect() as conn:
            got = conn.execute(
                sa.text(f"SELECT order_id, COUNT(*) FROM {self.config['orders']} GROUP BY order_id")
            )
            return {str(order): int(n) for order, n in got}

    def runs(self, order_id: str) -> int:
        """How many times the actor's body started for ``order_id`` (kept outside any tx)."""
        return int(self.redis.get(f"{self.config['namespace']}:runs:{order_id}") or 0)

    def close(self) -> None:
        self.broker.close()
        self.engine.dispose()
        self.redis.close()


def build(config: dict[str, Any]) -> App:
    namespace = config["namespace"]
    if config["broker"] == "rabbitmq":
        broker: dramatiq.Broker = RabbitmqBroker(url=AMQP_URL)
    else:
        # A SIGKILLed worker's unacked messages go back to the queue once its heartbeat is
        # older than heartbeat_timeout, checked by "maintenance" (every command, here).
        broker = RedisBroker(
            url=REDIS_URL,
            namespace=namespace,
            heartbeat_timeout=2000,
            maintenance_chance=MAINTENANCE_SCALE,
        )
    results = RedisBackend(url=REDIS_URL, namespace=f"{namespace}-results")
    broker.add_middleware(Results(backend=results))

    engine = sa.create_engine(PG_URL)
    client = redis.Redis.from_url(REDIS_URL)
    if config["store"] == "sql":
        store: SqlStore | RedisStore = SqlStore(engine, table=config["table"])
        guard = Idempotency(store, consumer=config["consumer"])
    else:
        store_url = config.get("store_url", REDIS_URL)
        store = RedisStore(store_url, prefix=f"{namespace}:idemq", socket_timeout_s=1.0)
        guard = Idempotency(store, consumer=config["consumer"], mode="lease", lease_s=10)

    key = None
    if config.get("key") == "order_id":

        def key(message: Any) -> str:
            return str(message.kwargs.get("order_id", message.args[0] if message.args else ""))

    broker.add_middleware(
        IdempotencyMiddleware(
            guard,
            key=key,
            retry_policy=RetryPolicy(in_progress_delay_s=0.2, store_unavailable_delay_s=0.2),
        )
    )
    if config.get("crash_at"):
        broker.add_middleware(_CrashBeforeAck(client, namespace, set(config["crash_at"])))
    orders = config["orders"]

    def pay(order_id: str, amount: int, tx: Any = None) -> dict[str, Any]:
        runs = client.incr(f"{namespace}:runs:{order_id}")
        assert tx is current_tx()  # both doors lead to the same transaction
        insert = sa.text(f"INSERT INTO {orders} (order_id, amount) VALUES (:o, :a)")
        if order_id.startswith("doomed") or (order_id.startswith("flaky") and runs == 1):
            if tx is not None:
                tx.execute(insert, {"o": order_id, "a": amount})  # rolled back by the raise
            raise RuntimeError(f"{order_id}: attempt {runs} fails")
        if order_id.startswith("slowfail") and runs == 1:
            # Hold the claim until the test lets go (a twin meets IN_PROGRESS), then fail.
            client.blpop([f"{namespace}:go:{order_id}"], timeout=30)
            raise RuntimeError(f"{order_id}: the first holder fails")
        if tx is not None:
            tx.execute(insert, {"o": order_id, "a": amount})
            if config.get("work_ms"):  # the transaction stays open: a kill lands inside it
                tx.execute(sa.text("SELECT pg_sleep(:s)"), {"s": config["work_ms"] / 1000})
        else:
            with engine.begin() as conn:
                conn.execute(insert, {"o": order_id, "a": amount})
        return {"paid": order_id, "amount": amount}

    actor = dramatiq.actor(
        pay,
        broker=broker,
        actor_name="pay",
        queue_name=config["queue"],
        store_results=True,
        min_backoff=MIN_BACKOFF_MS,
        max_backoff=MAX_BACKOFF_MS,
        max_retries=5,
    )

    def pay_many(order_ids: list[str], amount: int) -> int:
        # Direct calls of another actor: part of this message's effect, in its transaction.
        for order_id in order_ids:
            actor(order_id, amount)
        return len(order_ids)

    dramatiq.actor(
        pay_many,
        broker=broker,
        actor_name="pay_many",
        queue_name=config["queue"],
        store_results=True,
        min_backoff=MIN_BACKOFF_MS,
        max_backoff=MAX_BACKOFF_MS,
        max_retries=5,
    )

    def pay_after(order_id: str, previous: dict[str, Any], tx: Any = None) -> None:
        # The second step of a pipeline: Dramatiq appends the first step's result.
        actor(order_id, previous["amount"], tx=tx)

    dramatiq.actor(
        pay_after,
        broker=broker,
        actor_name="pay_after",
        queue_name=config["queue"],
        min_backoff=MIN_BACKOFF_MS,
        max_backoff=MAX_BACKOFF_MS,
        max_retries=5,
    )

    def note(order_id: str) -> None:
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"INSERT INTO {orders} (order_id, amount) VALUES (:o, 0)"), {"o": order_id}
            )

    dramatiq.actor(
        note, broker=broker, actor_name="note", queue_name=config["queue"], idempotent=False
    )
    return App(config, broker, engine, client, results, actor, guard)


def prepare(config: dict[str, Any]) -> None:
    """Create the business table (and the dedup table for SQL) before any worker starts."""
    engine = sa.create_engine(PG_URL)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"CREATE TABLE {config['orders']} (order_id VARCHAR(64), amount INT)")
            )
        if config["store"] == "sql":
            SqlStore(engine, table=config["table"]).create_schema()
    finally:
        engine.dispose()


def cleanup(config: dict[str, Any]) -> None:
    engine = sa.create_engine(PG_URL)
    try:
        if config["store"] == "sql":
            SqlStore(engine, table=config["table"]).drop_schema()
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {config['orders']}"))
    finally:
        engine.dispose()
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{config['namespace']}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
    if config["broker"] == "rabbitmq":
        import pika  # noqa: PLC0415 - only the RabbitMQ runs need it

        connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        try:
            channel = connection.channel()
            for suffix in ("", ".DQ", ".XQ"):
                channel.queue_delete(config["queue"] + suffix)
        finally:
            connection.close()


class _CrashBeforeAck(dramatiq.Middleware):
    """SIGKILL this process before the n-th ack (counted in Redis across restarts)."""

    def __init__(self, client: redis.Redis, namespace: str, crash_at: set[int]) -> None:
        self.client = client
        self.counter = f"{namespace}:acks"
        self.crash_at = crash_at

    def before_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        if int(self.client.incr(self.counter)) in self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    app = build(json.loads(os.environ[CONFIG_ENV]))
    worker = dramatiq.Worker(
        app.broker, worker_threads=int(app.config.get("worker_threads", 4)), worker_timeout=100
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker.start()
    print("ready", flush=True)
    stop.wait()
    worker.stop()
    app.close()


if __name__ == "__main__":
    main()
