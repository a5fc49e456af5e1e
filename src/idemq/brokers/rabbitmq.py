"""``amqp://user:pass@host:5672/vhost``: RabbitMQ through aio-pika (on its own loop thread).

* Queues are **quorum** queues: they count deliveries (``x-delivery-count``), which gives
  ``delivery_attempt`` and so ``max_attempts``; classic queues only say "redelivered".
* Each queue is declared with a native **DLX** (default exchange → ``<queue>.dlq``), so messages
  the broker itself dead-letters land next to ours. Our own dead letters are published there
  with the reason headers (confirmed) *then* acked: a crash between the two leaves a duplicate
  in the DLQ, never a loss. RabbitMQ's DLX cannot add a reason, hence the explicit publish.
* No ``x-delivery-limit``: redeliveries of IN_PROGRESS and store-outage messages must not
  count towards a limit (RabbitMQ 4 defaults it to 20 — set the policy off there).
* The id is the AMQP ``message_id`` property, else the ``idemq-message-id`` header. Producers
  must set it to a stable value: aio-pika/aiormq stamp a *random* ``message_id`` on any publish
  without one, so a retried publish would look like a new message (:mod:`.publish` sets it).
* Retry after a delay = keep the message unacked, nack(requeue) when the timer fires; if the
  connection drops first RabbitMQ requeues it anyway.
* Acks (and immediate nacks) are queued to the loop thread (:class:`~._aioloop.AckQueue`) rather
  than waited for one by one; AMQP has no reply to an ack anyway (the frame is written, that is
  all a client ever knows). While prefetched deliveries wait in the consumer's inbox, acks are
  held and go out together when it runs dry (or every 100, or 50 ms after the oldest), so
  the loop thread wakes once per burst, not once per message. ``close()`` sends what is queued
  before closing the connection. Not ``basic.ack multiple``: it would also ack the channel's
  earlier deliveries still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from idemq.brokers._aioloop import AckQueue, Inbox, LoopThread
from idemq.brokers.base import Delivery, Received, dead_letter_headers, outgoing_headers
from idemq.errors import BrokerUnavailableError

__all__ = ["RabbitMQBroker"]

log = logging.getLogger("idemq.brokers")

# ChannelInvalidStateError (a RuntimeError): an operation on a channel the broker closed, e.g.
# a late ack after RabbitMQ's consumer_timeout.
_DRIVER_ERRORS = (
    aio_pika.exceptions.AMQPException,
    aiormq.exceptions.ChannelInvalidStateError,
    OSError,
    asyncio.TimeoutError,
)


AMQP_MESSAGE_ID_MAX_BYTES = 255  # message-id is an AMQP short string


def _amqp_message_id(message_id: str | None) -> str | None:
    """``message_id`` for the AMQP property, or None when it does not fit one.

    A legal idemq id can be longer than 255 bytes in UTF-8 (100 emoji), and a header can carry an
    id of any length; aio-pika refuses such a property with a TypeError, which would leave the
    delivery unsettled and, with a small prefetch, stop the queue. The id still travels in the
    ``idemq-message-id`` header, which has no such limit.
    """
    if (
        message_id is None
        or len(message_id.encode("utf-8", "surrogatepass")) > AMQP_MESSAGE_ID_MAX_BYTES
    ):
        return None
    return message_id


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class RabbitMQBroker:
    """One robust connection; a confirming channel for publishes, one channel per consumer."""

    def __init__(self, url: str, *, confirm_timeout_s: float = 10.0) -> None:
        self.url = url
        self.confirm_timeout_s = confirm_timeout_s
        self._loop = LoopThread("idemq-amqp")
        self._settler = AckQueue(self._loop, "RabbitMQ")
        self._declared: set[str] = set()
        try:
            self._connection, self._channel = self._call(self._connect())
        except BrokerUnavailableError:
            self._loop.stop()
            raise

    @classmethod
    def from_url(cls, url: str) -> RabbitMQBroker:
        """Connect to the broker at ``url`` (an AMQP URL)."""
        return cls(url)

    async def _connect(self) -> tuple[AbstractRobustConnection, AbstractChannel]:
        connection = await aio_pika.connect_robust(self.url)
        channel = await connection.channel(publisher_confirms=True)
        return connection, channel

    def _call(self, coro: Any) -> Any:
        try:
            return self._loop.run(coro, self.confirm_timeout_s + 5)
        except _DRIVER_ERRORS as exc:
            raise BrokerUnavailableError(f"RabbitMQ: {type(exc).__name__}: {exc}") from exc

    def dead_letter_queue(self, queue: str) -> str:
        """``<queue>.dlq``, bound as the queue's DLX target."""
        return f"{queue}.dlq"

    async def _declare(self, channel: AbstractChannel, queue: str) -> aio_pika.abc.AbstractQueue:
        if queue.endswith(".dlq"):
            return await channel.declare_queue(queue, durable=True)
        await channel.declare_queue(self.dead_letter_queue(queue), durable=True)
        return await channel.declare_queue(
            queue,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self.dead_letter_queue(queue),
            },
        )

    def declare(self, queue: str) -> None:
        """Declare ``queue`` (quorum, with DLX) and ``<queue>.dlq``."""
        self._call(self._declare(self._channel, queue))

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue`` and its dead-letter queue (tests, tooling)."""

        async def delete() -> None:
            for name in (queue, self.dead_letter_queue(queue)):
                await self._channel.queue_delete(name)

        self._call(delete())

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Publish persistently through the default exchange and wait for the confirm."""
        all_headers: dict[str, Any] = dict(outgoing_headers(headers, message_id))
        message = aio_pika.Message(
            body,
            headers=all_headers,
            message_id=_amqp_message_id(message_id),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        self._call(
            self._channel.default_exchange.publish(
                message, routing_key=queue, timeout=self.confirm_timeout_s
            )
        )

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Push-consume ``queue`` with ``prefetch`` unacked messages at most."""
        inbox: Inbox[Delivery] = Inbox(on_dry=self._settler.flush)

        async def start() -> tuple[AbstractChannel, aio_pika.abc.AbstractQueue, str]:
            channel = await self._connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            declared = await self._declare(channel, queue)

            async def on_message(message: AbstractIncomingMessage) -> None:
                inbox.put(self._delivery(queue, message, inbox))

            tag = await declared.consume(on_message)
            return channel, declared, tag

        _channel, declared, tag = self._call(start())
        try:
            yield from inbox.drain()
        finally:
            # Stop receiving only; in-flight deliveries are settled on this channel, which
            # close() shuts (RabbitMQ then requeues whatever is still unacked).
            inbox.closed.set()
            self._settler.flush()  # acks held for the deliveries this consumer still had
            with contextlib.suppress(BrokerUnavailableError):
                self._call(declared.cancel(tag))

    def _delivery(
        self, queue: str, message: AbstractIncomingMessage, inbox: Inbox[Delivery]
    ) -> RabbitMQDelivery:
        headers = {key: _text(value) for key, value in (message.headers or {}).items()}
        count = headers.get("x-delivery-count", "0")
        attempt = int(count) + 1 if count.isdigit() else 1
        received = Received.build(
            queue,
            message.body,
            headers,
            broker_message_id=message.message_id,
            delivery_attempt=attempt,
        )
        return RabbitMQDelivery(self, received, message, inbox)

    def close(self) -> None:
        """Send the queued acks, close the connection (unacked messages go back to their
        queues) and the loop."""
        try:
            self._settler.drain(self.confirm_timeout_s)
            self._call(self._connection.close())
        except BrokerUnavailableError:
            pass
        finally:
            self._loop.stop()

    # used by RabbitMQDelivery -----------------------------------------------------------------

    def settle(self, coro: Any) -> None:
        """Run a settlement coroutine on the loop and wait, translating driver errors."""
        self._call(coro)

    def settle_soon(
        self, action: Callable[[], Awaitable[object]], *, hold: bool = False
    ) -> Future[None]:
        """Queue a settlement on the loop (see :class:`~._aioloop.AckQueue`); do not wait."""
        return self._settler.submit(action, hold=hold)

    def settle_later(self, delay_s: float, message: AbstractIncomingMessage) -> None:
        """nack(requeue) after ``delay_s``; the message stays unacked (invisible) until then."""
        self._loop.call_later(delay_s, lambda: message.nack(requeue=True))

    async def publish_dead_letter(
        self, queue: str, body: bytes, headers: Mapping[str, str], message_id: str | None
    ) -> None:
        """Publish to ``<queue>.dlq`` and wait for the confirm (runs on the loop)."""
        message = aio_pika.Message(
            body,
            headers=dict(headers),
            message_id=_amqp_message_id(message_id),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._channel.default_exchange.publish(
            message, routing_key=self.dead_letter_queue(queue), timeout=self.confirm_timeout_s
        )


class RabbitMQDelivery(Delivery):
    """An AMQP delivery on a consumer channel."""

    def __init__(
        self,
        broker: RabbitMQBroker,
        received: Received,
        message: AbstractIncomingMessage,
        inbox: Inbox[Delivery],
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self._message = message
        self._inbox = inbox

    def _ack(self) -> Future[None]:
        return self._broker.settle_soon(self._message.ack, hold=self._inbox.backlog())

    def _retry(self, delay_s: float) -> Future[None] | None:
        if delay_s <= 0:
            return self._broker.settle_soon(
                lambda: self._message.nack(requeue=True), hold=self._inbox.backlog()
            )
        self._broker.settle_later(delay_s, self._message)
        return None

    def _dead_letter(self, reason: str) -> None:
        headers = dead_letter_headers(
            self.headers, reason=reason, queue=self.queue, delivery_attempt=self.delivery_attempt
        )
        headers.pop("x-delivery-count", None)
        message_id = self.message.id if self.message else None

        async def move() -> None:
            # Publish (confirmed) before ack: a crash in between duplicates, never loses.
            try:
                await self._broker.publish_dead_letter(self.queue, self.body, headers, message_id)
            except Exception:
                # Never left unsettled (it would hold a prefetch slot for good): back to the
                # queue, to be dead-lettered again, and the failure in the log.
                log.exception("dead-lettering %s failed; requeued", self.describe())
                await self._message.nack(requeue=True)
                return
            await self._message.ack()

        self._broker.settle(move())
