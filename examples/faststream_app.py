"""A FastStream + RabbitMQ service whose payments happen once, however often a message arrives.

Run it (RabbitMQ on localhost, a SQLite file for the dedup table and the business table)::

    python examples/faststream_app.py            # or: faststream run examples.faststream_app:app

On startup it publishes three orders, each twice with the same AMQP ``message_id`` (what a
producer retry after a lost publisher-confirm looks like), waits for them and prints the
``payments`` table: one row per order. Set ``IDEMQ_STORE_URL`` (e.g.
``postgresql+psycopg://postgres@127.0.0.1:5432/test``) and ``AMQP_URL`` to use other servers.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import sqlalchemy as sa
from faststream import Context, FastStream
from faststream.rabbit import RabbitBroker, RabbitQueue
from sqlalchemy.ext.asyncio import AsyncConnection

from idemq import AsyncIdempotency, AsyncSqlStore
from idemq.integrations.faststream import TX_CONTEXT_KEY, IdempotencyMiddleware

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
STORE_URL = os.environ.get("IDEMQ_STORE_URL", "sqlite:///faststream_example.db")
QUEUE = RabbitQueue("idemq-example-orders", auto_delete=True)

store = AsyncSqlStore(STORE_URL)
guard = AsyncIdempotency(store, consumer="payments")  # transactional: SQL store default
broker = RabbitBroker(AMQP_URL, middlewares=[IdempotencyMiddleware(guard, max_attempts=5)])
app = FastStream(broker)
TX = Context(TX_CONTEXT_KEY)  # the dedup transaction, injected by FastStream
done = asyncio.Event()


@broker.subscriber(QUEUE)
async def pay(order: dict[str, Any], tx: AsyncConnection = TX) -> dict[str, Any]:
    """The business write goes through ``tx``: it commits with the dedup row or not at all."""
    await tx.execute(
        sa.text("INSERT INTO payments (order_id, amount) VALUES (:o, :a)"),
        {"o": order["order_id"], "a": order["amount"]},
    )
    if order["order_id"] == "order-3":
        done.set()
    return {"paid": order["order_id"]}  # stored; a duplicate gets this back without paying


@app.on_startup
async def create_tables() -> None:
    await store.create_schema()
    async with store.engine.begin() as conn:
        await conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS payments (order_id VARCHAR(64), amount INT)")
        )


@app.after_startup
async def demo() -> None:
    for n in (1, 2, 3):
        for _ in range(2):  # the same message twice
            await broker.publish(
                {"order_id": f"order-{n}", "amount": 10 * n}, queue=QUEUE, message_id=f"pay-{n}"
            )
    await asyncio.wait_for(done.wait(), timeout=10)
    await asyncio.sleep(0.5)  # let the last duplicate arrive
    async with store.engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT order_id, COUNT(*) FROM payments GROUP BY order_id ORDER BY order_id")
        )
        for order_id, count in rows:
            print(f"{order_id}: paid {count} time(s)")
    if os.environ.get("IDEMQ_EXAMPLE_KEEP_RUNNING") != "1":
        app.exit()


if __name__ == "__main__":
    asyncio.run(app.run())
