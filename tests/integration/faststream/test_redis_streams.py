"""IdempotencyMiddleware on Redis Streams (consumer groups, through FastStream), live."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from faststream.redis import RedisBroker, StreamSub

from tests.conftest import require_service
from tests.contract.faststream import Apply, FastStreamContract, as_handler, id_headers

URL = "redis://127.0.0.1:6379/0"
RECLAIM_IDLE_MS = 300

pytestmark = pytest.mark.redis


class TestRedisStreams(FastStreamContract):
    @pytest.fixture(autouse=True)
    def _redis(self) -> None:
        require_service("redis")

    def make_broker(self, middlewares: list[Any]) -> Any:
        return RedisBroker(URL, middlewares=middlewares, log_level=30)

    def subscribe(self, broker: Any, name: str, apply: Apply) -> None:
        group = f"{name}-group"
        broker.subscriber(
            stream=StreamSub(name, group=group, consumer="reader", polling_interval=100)
        )(as_handler(apply))
        # A nacked stream entry stays in the group's pending list; this second subscriber
        # (XAUTOCLAIM) takes entries idle for RECLAIM_IDLE_MS back — that is the retry path.
        broker.subscriber(
            stream=StreamSub(
                name,
                group=group,
                consumer="reclaimer",
                min_idle_time=RECLAIM_IDLE_MS,
                polling_interval=100,
            )
        )(as_handler(apply))

    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        await broker.publish(body, stream=name, headers=id_headers(message_id))

    async def cleanup(self, name: str) -> None:
        client = aioredis.from_url(URL)
        try:
            await client.delete(name)
        finally:
            await client.aclose()
