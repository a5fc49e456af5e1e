"""What differs between FastStream's brokers, behind one small interface.

FastStream gives every broker the same ``StreamMessage`` methods (``ack``/``nack``/``reject``), but
they mean different things, read from FastStream 0.7.8's message classes:

============  ======================  ==========================  ============================
broker        broker message id       ``nack()``                  ``reject()``
============  ======================  ==========================  ============================
RabbitMQ      AMQP ``message_id``     basic.nack requeue=True     basic.reject → the queue's DLX
NATS (JS)     ``Nats-Msg-Id`` header  NAK with ``delay``          TERM (never redelivered)
Kafka         —                       seek back to the record     **commit** (same as ack)
Redis Stream  —                       no-op: stays in the PEL     no-op: stays in the PEL
MQTT          —                       no-op (no nack in MQTT)     **PUBACK** (same as ack)
============  ======================  ==========================  ============================

So a :class:`Family` per broker (found by FastStream's message class) says where the id is, how
many deliveries the broker counted, how to have a message delivered again after a delay, and how
to drop a dead one. Retrying and dead-lettering are decided once, in
:func:`idemq.brokers.settlement.decide`.

Every settlement here is awaited before the middleware returns, and every message class guards
its settle calls (RabbitMQ ``raw.locked``, NATS ``raw._ackd``, the others ``committed``), so the
ack FastStream's own AcknowledgementMiddleware sends afterwards is a no-op, never a second ack.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

__all__ = ["Family", "family_of"]


class Family:
    """Generic behaviour (any StreamMessage): ``nack`` to retry, ``reject`` to drop."""

    name = "generic"
    # False: nack cannot bring the message back during this connection, so retry in place.
    redelivers = True

    def broker_message_id(self, msg: Any) -> str | None:
        """The id the broker itself carries, if it has one (never FastStream's random uuid)."""
        return None

    def source(self, msg: Any) -> str:
        """The queue/subject/topic/stream the message came from (for dead-letter headers)."""
        return ""

    def settled_on_arrival(self, msg: Any) -> bool:
        """Whether the broker already considers the message acknowledged (no-ack consume)."""
        return False

    async def broker_attempt(self, msg: Any) -> int:
        """The delivery count as the broker reports it (1 = first), or 0 when it cannot tell."""
        return 0

    async def retry(self, msg: Any, delay_s: float) -> None:
        """Have the message delivered again after about ``delay_s``."""
        # Holding the message (not acked) for the delay keeps a redelivery hot loop away; it
        # occupies this subscriber slot meanwhile, which is the back-pressure we want.
        await asyncio.sleep(delay_s)
        await msg.nack()

    async def dead_letter(self, msg: Any) -> None:
        """Remove the message from the queue for good (after ``on_dead_letter`` kept a copy)."""
        await msg.reject()


class RabbitFamily(Family):
    name = "rabbit"

    def broker_message_id(self, msg: Any) -> str | None:
        return getattr(msg.raw_message, "message_id", None) or None

    def source(self, msg: Any) -> str:
        return str(getattr(msg.raw_message, "routing_key", "") or "")

    def settled_on_arrival(self, msg: Any) -> bool:
        # aio-pika locks a delivery consumed with no_ack (FastStream's ACK_FIRST) on arrival. It
        # also locks one without a delivery tag, which no broker sent (FastStream's TestBroker).
        raw = msg.raw_message
        return bool(getattr(raw, "locked", False) and getattr(raw, "delivery_tag", None))

    async def broker_attempt(self, msg: Any) -> int:
        # Quorum queues count deliveries; classic queues only have the `redelivered` flag.
        count = (msg.headers or {}).get("x-delivery-count")
        return int(count) + 1 if count is not None else 0

    async def retry(self, msg: Any, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await msg.nack(requeue=True)

    async def dead_letter(self, msg: Any) -> None:
        # requeue=False: RabbitMQ routes it to the queue's dead-letter exchange, if it has one.
        await msg.reject(requeue=False)


class NatsFamily(Family):
    name = "nats"

    def broker_message_id(self, msg: Any) -> str | None:
        header = getattr(msg.raw_message, "header", None) or {}
        value = header.get("Nats-Msg-Id")
        return str(value) if value else None

    def source(self, msg: Any) -> str:
        return str(getattr(msg.raw_message, "subject", "") or "")

    async def broker_attempt(self, msg: Any) -> int:
        try:
            return int(msg.raw_message.metadata.num_delivered)
        except Exception:  # core NATS (no JetStream) has no delivery metadata
            return 0

    async def retry(self, msg: Any, delay_s: float) -> None:
        # JetStream delays the redelivery itself: nothing is held here.
        await msg.nack(delay=delay_s)


class KafkaFamily(Family):
    name = "kafka"

    def source(self, msg: Any) -> str:
        raw = msg.raw_message
        return str(getattr(raw, "topic", "") or "")

    async def dead_letter(self, msg: Any) -> None:
        # Kafka cannot remove one record; committing past it is the only way to move on.
        await msg.ack()


class RedisStreamFamily(Family):
    name = "redis-stream"

    def source(self, msg: Any) -> str:
        return str(msg.raw_message.get("channel", ""))

    async def broker_attempt(self, msg: Any) -> int:
        counts = msg.raw_message.get("delivery_counts")  # XREADGROUP CLAIM (Redis 8.4+)
        if counts:
            return int(counts[0]) + 1
        get_count = getattr(msg, "get_delivery_count", None)
        return int(await get_count()) if get_count is not None else 0

    async def retry(self, msg: Any, delay_s: float) -> None:
        # Left unacked in the pending list; a subscriber with StreamSub(min_idle_time=…)
        # (XAUTOCLAIM) takes it back after that idle time, which is the retry delay.
        await msg.nack()

    async def dead_letter(self, msg: Any) -> None:
        # FastStream's reject() leaves a stream entry pending forever; XACK removes it.
        await msg.ack()


class InPlaceFamily(Family):
    """Brokers whose nack does nothing (MQTT, Redis lists/pub-sub): retries run in place."""

    name = "in-place"
    redelivers = False

    def source(self, msg: Any) -> str:
        raw = msg.raw_message
        if isinstance(raw, dict):
            return str(raw.get("channel", ""))
        return str(getattr(raw, "topic", "") or "")

    async def dead_letter(self, msg: Any) -> None:
        await msg.ack()  # MQTT PUBACK: the broker stops redelivering it


_GENERIC = Family()
_IN_PLACE = InPlaceFamily()
_REDIS_STREAMS = ("RedisStreamMessage", "RedisBatchStreamMessage")
_REDIS_OTHERS = ("RedisMessage", "RedisListMessage", "RedisBatchListMessage", "RedisChannelMessage")

# FastStream's message classes (``faststream.<broker>.message``; the names the broker packages
# export are ``Annotated`` aliases for dependency injection, not classes), and their family.
_MESSAGE_CLASSES: tuple[tuple[str, tuple[str, ...], Family], ...] = (
    ("faststream.rabbit.message", ("RabbitMessage",), RabbitFamily()),
    ("faststream.nats.message", ("NatsMessage",), NatsFamily()),
    ("faststream.kafka.message", ("KafkaMessage",), KafkaFamily()),
    ("faststream.confluent.message", ("KafkaMessage",), KafkaFamily()),
    (
        "faststream.redis.message",
        ("RedisStreamMessage", "RedisBatchStreamMessage"),
        RedisStreamFamily(),
    ),
    (
        "faststream.redis.message",
        ("RedisMessage", "RedisListMessage", "RedisChannelMessage"),
        _IN_PLACE,
    ),
    ("faststream.redis.message", ("RedisBatchListMessage",), _IN_PLACE),
    ("faststream.mqtt.message", ("MQTTMessage",), _IN_PLACE),
)


def family_of(msg: Any) -> Family:
    """The :class:`Family` of a FastStream message: the one whose message class it is an
    instance of (:class:`Family`'s generic behaviour for any other)."""
    for module, names, family in _MESSAGE_CLASSES:
        # Only a broker package already imported can have made a message: looking it up does
        # not import the other brokers' client libraries (or fail where they are missing).
        package = sys.modules.get(module)
        if package is not None and isinstance(msg, tuple(getattr(package, n) for n in names)):
            return family
    return _GENERIC
