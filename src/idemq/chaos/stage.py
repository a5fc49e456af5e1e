"""What a chaos run puts on the servers before it starts (the order tables seeded, the dedup
table, the outbox, the queues), and the cleanup that takes exactly that off again.

Every name carries the run's prefix (:class:`~idemq.chaos.plan.RunPlan`), so the cleanup never
touches what another run, or the user, created.
"""

from __future__ import annotations

import random

import sqlalchemy as sa

from idemq.chaos import faults
from idemq.chaos.faults import ProducerBroker
from idemq.chaos.orders import create_schema, drop_schema, seed
from idemq.chaos.plan import RunPlan

__all__ = ["declare_queues", "delete_queues", "set_up", "tear_down"]


def set_up(plan: RunPlan, engine: sa.Engine) -> None:
    """Create and seed the order tables; the dedup table and the outbox where the run uses them."""
    c = plan.config
    create_schema(engine, plan.tables)
    rng = random.Random(c.seed)
    accounts = {f"acct-{n}": c.opening_balance_cents for n in range(c.accounts)}
    orders = [
        (f"order-{n:07d}", f"acct-{n % c.accounts}", rng.randint(100, 50_000))
        for n in range(c.messages)
    ]
    with engine.begin() as conn:
        seed(conn, plan.tables, accounts, orders)
    if c.guard and not plan.redis_store:
        from idemq.stores.sql.store import SqlStore  # noqa: PLC0415

        store = SqlStore(c.store_url, table=f"{plan.prefix}dedup")
        store.create_schema()
        store.close()
    if plan.ship_queue:
        with plan.outbox() as outbox:
            outbox.create_schema()


def declare_queues(plan: RunPlan, producer: ProducerBroker) -> None:
    """The pay queue (and the ship queue on two hops), sized for their consumers."""
    url = plan.config.broker_url
    faults.declare_queue(producer, url, plan.queue, consumers=plan.config.workers)
    if plan.ship_queue:
        faults.declare_queue(producer, url, plan.ship_queue, consumers=plan.ship_workers)


def delete_queues(plan: RunPlan, producer: ProducerBroker) -> None:
    producer.delete_queue(plan.queue)
    if plan.ship_queue:
        producer.delete_queue(plan.ship_queue)


def tear_down(plan: RunPlan, engine: sa.Engine) -> None:
    """Drop the run's tables and delete its Redis keys (all named with the run's prefix)."""
    if plan.ship_queue:
        with plan.outbox() as outbox:
            outbox.drop_schema()
    drop_schema(engine, plan.tables)
    if plan.config.guard and not plan.redis_store:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {plan.prefix}dedup"))
    if plan.redis_store:
        import redis  # noqa: PLC0415

        client = redis.Redis.from_url(plan.config.store_url)
        try:
            keys = list(client.scan_iter(match=f"{plan.prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
