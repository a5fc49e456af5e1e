"""A refusal is a refusal on every broker: the refused row goes dead after ``max_attempts`` and
the rows behind it move on; an outage is never counted (test_outbox_outage.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
import nats
import pytest
import redis
import sqlalchemy as sa
from nats.js.api import StreamConfig

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.errors import BrokerRefusedError
from idemq.outbox import outbox_stats
from tests.conftest import REDIS_URL, require_service, unique
from tests.integration.brokers.test_kafka import tansu  # noqa: F401 - the Kafka fixture
from tests.integration.test_outbox_relay import receive

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"
TOO_BIG = b"x" * (2 * 1024 * 1024)  # over NATS's max_payload and Kafka's message.max.bytes


@dataclass
class Refused:
    """One way a broker refuses a message: where it goes, its body and its headers."""

    destination: str
    body: bytes = b"refused"
    headers: dict[str, str] = field(default_factory=dict)


def _full_amqp_queue() -> str:
    """A classic queue of one message that rejects further publishes, already full."""
    name = unique("full")

    async def make() -> None:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            args = {"x-max-length": 1, "x-overflow": "reject-publish"}
            await channel.declare_queue(name, arguments=args)
            await channel.default_exchange.publish(aio_pika.Message(b"first"), routing_key=name)

    asyncio.run(make())
    return name


def _small_nats_stream() -> str:
    """A subject whose stream (someone else's, adopted as it is) takes messages of 1000 bytes."""
    subject = unique("small")

    async def make() -> None:
        client = await nats.connect(NATS_URL)
        try:
            config = StreamConfig(name=subject, subjects=[subject], max_msg_size=1000)
            await client.jetstream().add_stream(config)
        finally:
            await client.close()

    asyncio.run(make())
    return subject


def _redis_string_key() -> str:
    """A key of someone else's holding a string: no stream can be appended to it."""
    name = unique("string")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.set(name, "not a stream", ex=600)
    finally:
        client.close()
    return name


# (broker, how the refused message looks: made from the good queue's name)
CASES: dict[str, tuple[str, Callable[[str], Refused]]] = {
    "amqp-full-queue-reject-publish": ("amqp", lambda _q: Refused(_full_amqp_queue())),
    "amqp-headers-over-the-frame-size": (
        "amqp",
        lambda q: Refused(q, headers={"h": "v" * 200_000}),
    ),
    "amqp-header-name-over-128-bytes": ("amqp", lambda q: Refused(q, headers={"n" * 129: "v"})),
    "nats-subject-no-stream-captures": ("nats", lambda _q: Refused(unique("nostream"))),
    "nats-body-over-max-payload": ("nats", lambda q: Refused(q, body=TOO_BIG)),
    "nats-body-over-the-streams-max-msg-size": (
        "nats",
        lambda _q: Refused(_small_nats_stream(), body=b"x" * 2000),
    ),
    "kafka-body-over-the-size-limit": ("kafka", lambda q: Refused(q, body=TOO_BIG)),
    "redis-destination-a-key-of-another-type": ("redis", lambda _q: Refused(_redis_string_key())),
}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, Callable[[str], Refused]]:
    kind, make = CASES[request.param]
    if kind == "kafka":
        bootstrap: str = request.getfixturevalue("tansu")
        return f"kafka://{bootstrap}?session_timeout_ms=2000", make
    service = {"amqp": "rabbitmq", "nats": "nats", "redis": "redis"}[kind]
    require_service(service)
    return {"amqp": AMQP_URL, "nats": NATS_URL, "redis": REDIS_URL}[kind], make


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[idemq.Outbox]:
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'outbox.db'}")
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


def test_a_refused_row_goes_dead_and_the_rows_behind_it_move_on(
    outbox: idemq.Outbox, case: tuple[str, Callable[[str], Refused]]
) -> None:
    url, make = case
    good = unique("good")
    broker: Broker = open_broker(url)
    try:
        broker.declare(good)
        refused = make(good)
        with pytest.raises(BrokerRefusedError):  # a refusal, said as one, not an outage
            broker.publish(
                refused.destination,
                refused.body,
                headers=refused.headers,
                message_id=f"direct-{uuid.uuid4().hex}",
            )
        with outbox.engine.begin() as conn:
            doomed = outbox.add(
                conn, refused.destination, refused.body, headers=refused.headers, ordering_key="k"
            )
            behind = outbox.add(conn, good, b"behind", ordering_key="k")
            other = outbox.add(conn, good, b"other", ordering_key="j")
        now = [outbox.clock()]
        relay = idemq.OutboxRelay(outbox, url, max_attempts=3, backoff_s=1, clock=lambda: now[0])
        try:
            for _ in range(8):  # three attempts, the backoff skipped on the relay's clock
                relay.run_once()
                now[0] += 600_000
                if outbox_stats(outbox).pending == 0:
                    break
        finally:
            relay.close()
        stats = outbox_stats(outbox)
        assert (stats.pending, stats.dead) == (0, 1)
        with outbox.engine.connect() as conn:
            dead = conn.execute(sa.text(f"SELECT id, attempts FROM {outbox.table}_dead")).one()
        assert tuple(dead) == (doomed, 3)
        got = receive(broker, good, 2, timeout_s=60)
        assert sorted(d.message.id for d in got if d.message) == sorted([behind, other])
        assert [d.body for d in got if d.message and d.message.id == behind] == [b"behind"]
    finally:
        broker.close()
