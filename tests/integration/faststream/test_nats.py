"""IdempotencyMiddleware on NATS JetStream (nats-py through FastStream), live."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import nats
import pytest
from faststream.nats import JStream, NatsBroker, PullSub

from tests.conftest import require_service
from tests.contract.faststream import (
    Apply,
    Db,
    Deliveries,
    FastStreamContract,
    as_handler,
    id_headers,
    wait_until,
)

URL = "nats://127.0.0.1:4222"

pytestmark = pytest.mark.nats


class TestNatsJetStream(FastStreamContract):
    @pytest.fixture(autouse=True)
    def _nats(self) -> None:
        require_service("nats")

    def make_broker(self, middlewares: list[Any]) -> Any:
        return NatsBroker(URL, middlewares=middlewares, log_level=30)

    def subscribe(self, broker: Any, name: str, apply: Apply) -> None:
        broker.subscriber(
            name,
            stream=JStream(name, subjects=[name]),
            durable=name,
            pull_sub=PullSub(batch_size=10, timeout=0.2),
        )(as_handler(apply))

    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        # The idemq header, not Nats-Msg-Id: JetStream itself drops a second publish with the
        # same Nats-Msg-Id inside its duplicate window, and these tests need the duplicates.
        await broker.publish(body, name, headers=id_headers(message_id), stream=name)

    async def cleanup(self, name: str) -> None:
        nc = await nats.connect(URL)
        try:
            await nc.jetstream().delete_stream(name)
        except nats.js.errors.NotFoundError:
            pass
        finally:
            await nc.close()

    async def test_nats_msg_id_is_the_key(self, db: Db, name: str) -> None:
        order = "order-nats-msg-id"

        async def body(broker: Any, deliveries: Deliveries) -> None:
            await broker.publish(
                {"order_id": order}, name, headers={"Nats-Msg-Id": "nats-42"}, stream=name
            )
            await wait_until(lambda: _done(deliveries, 1), "the delivery")
            await asyncio.sleep(0.2)

        await self.run(db, name, body)
        assert await db.rows() == Counter({order: 1})
        assert await db.store.get("nats-42", consumer=name) is not None


async def _done(deliveries: Deliveries, n: int) -> bool:
    return deliveries.done >= n
