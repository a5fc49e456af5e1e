"""``amqp://user:pass@host:5672/vhost``: RabbitMQ through aio-pika (on its own loop thread).

* **A queue that exists is used as it is**, whatever its type and arguments (a passive declare
  looks first; idemq never redeclares it, so an application's classic queue without a DLX
  works). Only a queue that is missing is created (``?declare=never``: nothing is created, a
  missing queue is a :class:`~idemq.ConfigurationError`). Queues idemq creates are **quorum**
  queues (replicated, with a DLX). ``x-delivery-count`` is *not* the attempt number: it also
  counts the redeliveries a store outage or a lease held by a twin caused, and those must never
  dead-letter a message. idemq's attempt number travels in the ``idemq-delivery-attempt``
  header instead (see the retries below), on classic queues as on quorum ones.
* Dead letters go to ``<queue>.dlq`` (``?dead_letter=NAME`` names another queue), created if
  missing. A queue idemq creates has it as its native **DLX** (default exchange), so messages
  the broker itself dead-letters land next to ours. Our own dead letters are published there
  with the reason headers (confirmed) *then* acked: a crash between the two leaves a duplicate
  in the DLQ, never a loss — with or without a DLX on the queue. RabbitMQ's DLX cannot add a
  reason, hence the explicit publish. The copy is ``mandatory``: if no queue takes it (the
  dead-letter queue was deleted), RabbitMQ returns it, and the original is requeued, not acked.
* No ``x-delivery-limit``: redeliveries of IN_PROGRESS and store-outage messages must not
  count towards a limit (RabbitMQ 4 defaults it to 20 — set the policy off there).
* The id is the AMQP ``message_id`` property, else the ``idemq-message-id`` header. Producers
  must set it to a stable value: aio-pika/aiormq stamp a *random* ``message_id`` on any publish
  without one, so a retried publish would look like a new message (:mod:`.publish` sets it).
* Retry after a delay = keep the message unacked until the timer fires, then: after an outage
  or a busy lease, ``nack(requeue)`` (the same message, the same attempt number); after a failed
  handler run, publish a copy with ``idemq-delivery-attempt`` + 1 (confirmed) and ack the
  original — a crash in between leaves two copies, which the guard absorbs, never none. If the
  connection drops first, RabbitMQ requeues the original anyway.
* Consuming happens on aiormq's channel under aio-pika's (``get_underlay_channel``): a delivery
  is aiormq's ``DeliveredMessage``, settled by its delivery tag, with no aio-pika
  ``IncomingMessage`` per message.
* Acks (and immediate nacks) are queued to the loop thread (:class:`~._aioloop.AckQueue`) rather
  than waited for one by one; AMQP has no reply to an ack anyway (the frame is written, that is
  all a client ever knows). While prefetched deliveries wait in the consumer's inbox, acks are
  held and go out together when it runs dry (or every 100, or 50 ms after the oldest), so
  the loop thread wakes once per burst, not once per message. A burst's acks leave as one
  ``basic.ack multiple`` up to the last delivery that nothing unsettled precedes, and one plain
  ``basic.ack`` each for those behind an unsettled one (:class:`_Acks`): ``multiple`` never
  acks a delivery still in flight. ``close()`` sends what is queued before closing the
  connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
import aiormq.abc
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from pamqp import frame, header

from idemq.brokers._aioloop import Inbox, LoopBroker
from idemq.brokers.base import (
    ATTEMPT_HEADER,
    DEAD_LETTER_HEADERS,
    NOT_BEFORE_HEADER,
    Delivery,
    Received,
    Traits,
    check_declare_mode,
    header_text,
    outgoing_headers,
    split_query,
)
from idemq.drivers.urls import mask_url
from idemq.errors import (
    BrokerError,
    BrokerRefusedError,
    BrokerUnavailableError,
    ConfigurationError,
)

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


# What RabbitMQ answers a connection it will never accept as configured (retrying cannot help):
# a refused login, or an unknown or forbidden vhost: RabbitMQ closes the connection (530
# NOT_ALLOWED) in the middle of the handshake, which aiormq reports as an unexpected frame.
_REFUSALS = (
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.InvalidFrameError,
)


def _refusal(exc: Exception, url: str) -> Exception:
    """The idemq error for a refused connection: :class:`ConfigurationError` when RabbitMQ said
    no to the credentials or the vhost, :class:`BrokerUnavailableError` otherwise."""
    if isinstance(
        exc, aiormq.exceptions.AuthenticationError | aiormq.exceptions.ProbableAuthenticationError
    ):
        return ConfigurationError(
            f"RabbitMQ refused the login (check the URL's user and password): {exc}"
        )
    if "Connection.Close" in str(exc):
        vhost = unquote(urlsplit(url).path.removeprefix("/")) or "/"
        return ConfigurationError(
            f"RabbitMQ closed the connection at login: vhost {vhost!r} does not exist"
            " or the user may not use it"
        )
    return BrokerUnavailableError(f"RabbitMQ: {type(exc).__name__}: {exc}")


# How long a channel or connection close is waited for once the connection is known to be lost.
_CLOSE_WHEN_LOST_S = 2.0

AMQP_MESSAGE_ID_MAX_BYTES = 255  # message-id is an AMQP short string
AMQP_HEADER_NAME_MAX_BYTES = 128  # a field-table name (pamqp cuts longer ones silently)
AMQP_FRAME_MAX = 131072  # RabbitMQ's default frame_max


def _check_header_names(headers: Mapping[str, Any]) -> None:
    """Refuse a header name longer than AMQP allows: cut short it would arrive as another
    header (two long names could even become one)."""
    for name in headers:
        if len(name.encode("utf-8", "surrogatepass")) > AMQP_HEADER_NAME_MAX_BYTES:
            raise BrokerRefusedError(
                f"AMQP header names are at most {AMQP_HEADER_NAME_MAX_BYTES} bytes:"
                f" {name[:40]!r}… has {len(name.encode('utf-8', 'surrogatepass'))}"
            )


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


def _amqp_value(value: Any) -> Any:
    """A received header value as one pamqp can send again: a long string that was not UTF-8
    arrives as ``bytes``, which pamqp refuses to encode; as ``bytearray`` it goes out as an
    AMQP byte array with the same bytes (nested tables and arrays alike)."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {key: _amqp_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_amqp_value(item) for item in value]
    return value


class _Acks:
    """The acks of one consumer channel, sent in as few frames as AMQP allows (loop thread only).

    A queued ack is only marked here; the settler's confirm step (:meth:`RabbitMQBroker.send_acks`,
    once per batch, before the batch's futures complete) sends them: one ``basic.ack multiple``
    up to the last tag of the run of marked deliveries that nothing unsettled precedes, then one
    plain ``basic.ack`` for each marked delivery behind an unsettled one (a delivery waiting for
    a delayed retry, or still with the worker). ``multiple`` never reaches a delivery in flight:
    every delivery of the channel is recorded here on arrival, in tag order, until it is settled.
    One frame (and one write) per batch instead of one per message, on the client and on
    RabbitMQ alike. Frames go with ``wait=False``: queued for aiormq's writer, not waited for
    one by one (AMQP answers no ack or nack; a frame a dropped connection loses leaves its
    message unacked, and RabbitMQ redelivers it).
    """

    def __init__(self, channel: aiormq.abc.AbstractChannel) -> None:
        self.channel = channel
        self._unsettled: dict[int, bool] = {}  # delivery tag → marked for ack, in delivery order

    def delivered(self, tag: int) -> None:
        self._unsettled[tag] = False

    def mark(self, tag: int) -> None:
        """Ack ``tag`` with the next :meth:`send`; raises at once on a closed channel."""
        if self.channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} closed")
        self._unsettled[tag] = True

    async def ack_now(self, tag: int) -> None:
        await self.channel.basic_ack(tag)
        self._unsettled.pop(tag, None)

    async def requeue(self, tag: int) -> None:
        await self.channel.basic_nack(tag, requeue=True, wait=False)
        self._unsettled.pop(tag, None)

    async def send(self) -> None:
        marked = [tag for tag, ack in self._unsettled.items() if ack]
        if not marked:
            return
        first_open = next((tag for tag, ack in self._unsettled.items() if not ack), None)
        covered = [tag for tag in marked if first_open is None or tag < first_open]
        for tag in marked:
            del self._unsettled[tag]
        if covered:
            await self.channel.basic_ack(covered[-1], multiple=len(covered) > 1, wait=False)
        for tag in marked[len(covered) :]:
            await self.channel.basic_ack(tag, wait=False)


class RabbitMQBroker(LoopBroker):
    """One robust connection; a confirming channel for publishes, one channel per consumer."""

    # Its redelivery timer, consumer_timeout, is the server's (server-wide before 3.12).
    TRAITS: ClassVar[Traits] = Traits(topology_options=True)

    def __init__(
        self,
        url: str,
        *,
        confirm_timeout_s: float = 10.0,
        declare: str = "auto",
        dead_letter: str | None = None,
    ) -> None:
        self.url = url
        self.confirm_timeout_s = confirm_timeout_s
        self.declare_mode = check_declare_mode(declare)
        self.dead_letter = dead_letter
        self._acks: set[_Acks] = set()  # the live consumers' (touched on the loop thread only)
        super().__init__(
            "RabbitMQ",
            driver_errors=_DRIVER_ERRORS,
            call_timeout_s=confirm_timeout_s + 5,
            confirm=self.send_acks,
        )
        try:
            self._connection, self._channel = self._call(self._connect())
        except (BrokerUnavailableError, ConfigurationError):
            self._loop.stop()
            raise

    @classmethod
    def from_url(cls, url: str) -> RabbitMQBroker:
        """Connect to the broker at ``url`` (an AMQP URL). idemq's own parameters,
        ``declare=auto|never`` and ``dead_letter=NAME``, are taken out of its query; the rest
        (``heartbeat=…`` and the like) goes to aio-pika."""
        plain, ours = split_query(url, ("declare", "dead_letter"))
        return cls(plain, declare=ours.get("declare", "auto"), dead_letter=ours.get("dead_letter"))

    async def _connect(self) -> tuple[AbstractRobustConnection, AbstractChannel]:
        try:
            connection = await aio_pika.connect_robust(self.url)
        except _REFUSALS as exc:
            raise _refusal(exc, self.url) from exc
        channel = await connection.channel(publisher_confirms=True)
        return connection, channel

    def dead_letter_queue(self, queue: str) -> str:
        """``dead_letter`` if given, else ``<queue>.dlq`` (the DLX target of queues idemq
        creates)."""
        return self.dead_letter or f"{queue}.dlq"

    async def _exists(self, queue: str) -> bool:
        """Whether ``queue`` exists (a passive declare, on a channel of its own: RabbitMQ
        closes the channel that asked about a missing queue)."""
        channel = await self._connection.channel()
        try:
            await channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        except (
            aiormq.exceptions.ChannelAccessRefused,
            aiormq.exceptions.ChannelLockedResource,
        ) as exc:
            raise ConfigurationError(f"RabbitMQ queue {queue!r} cannot be used: {exc}") from exc
        finally:
            if not channel.is_closed:
                await channel.close()
        return True

    async def _adopt_or_create(
        self, channel: AbstractChannel, queue: str, arguments: dict[str, Any]
    ) -> aio_pika.abc.AbstractQueue:
        if await self._exists(queue):
            return await channel.declare_queue(queue, passive=True)
        if self.declare_mode == "never":
            raise ConfigurationError(
                f"RabbitMQ queue {queue!r} does not exist (declare=never: idemq creates nothing)"
            )
        try:
            return await channel.declare_queue(queue, durable=True, arguments=arguments or None)
        except (
            aio_pika.exceptions.ChannelPreconditionFailed,
            aiormq.exceptions.ChannelAccessRefused,
        ) as exc:  # made meanwhile with other arguments, or not ours to make
            raise ConfigurationError(f"RabbitMQ queue {queue!r} cannot be used: {exc}") from exc

    async def _declare(self, channel: AbstractChannel, queue: str) -> aio_pika.abc.AbstractQueue:
        dead = self.dead_letter_queue(queue)
        if queue == dead or queue.endswith(".dlq"):  # consuming the dead letters themselves
            return await self._adopt_or_create(channel, queue, {})
        await self._adopt_or_create(channel, dead, {})
        return await self._adopt_or_create(
            channel,
            queue,
            {
                "x-queue-type": "quorum",
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": dead,
            },
        )

    def declare(self, queue: str) -> None:
        """Adopt ``queue`` and its dead-letter queue as they are, creating what is missing
        (``queue`` as a quorum queue whose DLX is the dead-letter queue)."""
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
        """Publish persistently through the default exchange and wait for the confirm.

        The publish is ``mandatory``: a message no queue takes (``queue`` not declared yet) is
        returned by RabbitMQ instead of dropped. That, a ``basic.nack`` (a full queue with
        ``x-overflow=reject-publish``), a header name over AMQP's 128 bytes and headers over the
        connection's frame size are raised as :class:`~idemq.errors.BrokerRefusedError`, not an
        outage: publishing the message again would meet the same fate.
        """
        all_headers: dict[str, Any] = dict(outgoing_headers(headers, message_id))
        _check_header_names(all_headers)
        message = aio_pika.Message(
            body,
            headers=all_headers,
            message_id=_amqp_message_id(message_id),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        self._check_header_frame(message)

        async def confirmed() -> Any:
            try:
                return await self._channel.default_exchange.publish(
                    message, routing_key=queue, mandatory=True, timeout=self.confirm_timeout_s
                )
            except aiormq.exceptions.DeliveryError as exc:
                raise BrokerRefusedError(
                    f"RabbitMQ refused the message for {queue!r} (basic.nack: a full queue"
                    f" that rejects publishes, or a queue that failed): {exc}"
                ) from exc

        answer = self._call(confirmed())
        # With confirms, aio_pika answers a returned (unroutable) message with the message
        # itself instead of the broker's Basic.Ack.
        if isinstance(answer, aiormq.abc.DeliveredMessage):
            raise BrokerRefusedError(
                f"RabbitMQ returned the message: no queue {queue!r} to route it to"
                " (declare the queue, or start its worker, before publishing)"
            )

    def _check_header_frame(self, message: aio_pika.Message) -> None:
        """Refuse properties that do not fit one frame: RabbitMQ would close the whole
        connection (FRAME_ERROR), failing every publish in flight on it, and the same message
        would do it again on the next connection."""
        size = len(frame.marshal(header.ContentHeader(0, len(message.body), message.properties), 1))
        frame_max = self._frame_max()
        if size > frame_max:
            raise BrokerRefusedError(
                f"RabbitMQ: the message's properties and headers take {size} bytes, over the"
                f" connection's frame size of {frame_max} bytes"
            )

    def _frame_max(self) -> int:
        """The frame size negotiated with RabbitMQ (its default when not connected yet)."""
        transport = self._connection.transport
        tune = getattr(transport.connection, "connection_tune", None) if transport else None
        frame_max = getattr(tune, "frame_max", 0)
        return frame_max if isinstance(frame_max, int) and frame_max > 0 else AMQP_FRAME_MAX

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Push-consume ``queue`` with ``prefetch`` unacked messages at most."""
        inbox: Inbox[Delivery] = Inbox(on_dry=self._settler.flush)

        async def start() -> tuple[AbstractChannel, _Acks, str]:
            if not self._connection.connected.is_set():
                # The robust connection is reconnecting: opening a channel would wait for it
                # (past the worker's --give-up-after and its SIGTERM). Fail this attempt now;
                # the worker's outage retries log it, and the next one finds it reconnected.
                raise BrokerUnavailableError(f"RabbitMQ: not connected to {mask_url(self.url)}")
            channel = await self._connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            await self._declare(channel, queue)
            # aiormq's channel under aio-pika's, consumed on directly: a delivery is aiormq's
            # DeliveredMessage as read off the wire, settled by its delivery tag, without an
            # aio-pika IncomingMessage (and its lock and callbacks) per message.
            amqp = await channel.get_underlay_channel()
            acks = _Acks(amqp)

            # aiormq runs each delivery's callback as a task of its own; those of one read off
            # the socket run in the same turn of the loop and reach the worker as one burst.
            burst: list[Delivery] = []

            def hand_over() -> None:
                nonlocal burst
                inbox.put(burst)
                burst = []

            async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
                tag = message.delivery_tag
                if tag is None:  # aiormq's type also covers returns and gets; never a deliver
                    raise BrokerError(f"RabbitMQ: a delivery without a tag on {queue!r}")
                acks.delivered(tag)
                if not burst:
                    asyncio.get_running_loop().call_soon(hand_over)
                burst.append(self._delivery(queue, message, tag, inbox, acks))

            consume_ok = await amqp.basic_consume(queue, on_message)
            self._acks.add(acks)
            return channel, acks, consume_ok.consumer_tag or ""

        channel, acks, tag = self._call(start())
        amqp = acks.channel
        lost = False
        try:
            for delivery in inbox.drain():
                # The robust connection reconnects by itself and says nothing: without this
                # check a running worker idled through an outage of any length, with no log
                # line and no --give-up-after. The aiormq channel is the one consumed on: a
                # channel RabbitMQ closed (a late ack after its consumer_timeout) is reopened
                # by aio-pika without this consumer, so it counts as lost too.
                if not self._connection.connected.is_set() or amqp.is_closed:
                    lost = True
                    raise BrokerUnavailableError(
                        f"RabbitMQ: the connection to {mask_url(self.url)} was lost"
                    )
                yield delivery
        finally:
            inbox.closed.set()
            self._settler.flush()  # acks held for the deliveries this consumer still had
            if lost:
                # Closed, not cancelled: a consumer nobody reads must not keep its messages
                # unacked. Bounded: the connection is down, nothing may answer.
                with contextlib.suppress(BrokerUnavailableError, *_DRIVER_ERRORS):
                    self._loop.run(channel.close(), _CLOSE_WHEN_LOST_S)
            else:
                # Stop receiving only; in-flight deliveries are settled on this channel, which
                # close() shuts (RabbitMQ then requeues whatever is still unacked).
                with contextlib.suppress(BrokerUnavailableError):
                    self._call(amqp.basic_cancel(tag))

    def _delivery(
        self,
        queue: str,
        message: aiormq.abc.DeliveredMessage,
        tag: int,
        inbox: Inbox[Delivery],
        acks: _Acks,
    ) -> RabbitMQDelivery:
        properties = message.header.properties
        headers: dict[str, str] = {}
        undecodable: list[str] = []
        for key, value in (properties.headers or {}).items():
            headers[key], is_text = header_text(value)
            if not is_text:
                undecodable.append(key)
        received = Received.build(
            queue,
            message.body,
            headers,
            broker_message_id=properties.message_id,
            undecodable=undecodable,
        )
        return RabbitMQDelivery(self, received, message, tag, inbox=inbox, acks=acks)

    def close(self) -> None:
        """Send the queued acks, close the connection (unacked messages go back to their
        queues) and the loop."""
        # Connection lost: nothing queued can reach RabbitMQ (it requeues those messages
        # itself), and waiting for it would hold a stopping worker up (SIGTERM prompt).
        wait_s = self.confirm_timeout_s
        if not self._connection.connected.is_set():
            wait_s = _CLOSE_WHEN_LOST_S
        try:
            self._settler.drain(wait_s)
            self._loop.run(self._connection.close(), wait_s + 5)
        except (BrokerUnavailableError, *_DRIVER_ERRORS):
            pass
        finally:
            self._loop.stop()

    # used by RabbitMQDelivery -----------------------------------------------------------------

    async def send_acks(self) -> None:
        """The settler's confirm step: send the acks its batch marked, every consumer's (a
        channel that failed does not keep the others' acks back; its error is raised after).
        A closed channel's consumer is forgotten here: nothing can be acked on it any more."""
        failed: Exception | None = None
        for acks in list(self._acks):
            try:
                await acks.send()
            except Exception as exc:
                failed = exc
            if acks.channel.is_closed:
                self._acks.discard(acks)
        if failed is not None:
            raise failed

    async def publish_copy(
        self, routing_key: str, body: bytes, headers: Mapping[str, Any], message_id: str | None
    ) -> None:
        """Publish persistently to ``routing_key`` and wait for the confirm (runs on the loop).

        ``mandatory``: without it RabbitMQ confirms a message no queue took (a dead-letter
        queue deleted while the worker runs) and drops it, and the caller would ack the
        original: a lost message. A returned copy raises :class:`BrokerError` instead, so the
        caller keeps the original (requeues it).
        """
        message = aio_pika.Message(
            body,
            headers=dict(headers),
            message_id=_amqp_message_id(message_id),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        answer = await self._channel.default_exchange.publish(
            message, routing_key=routing_key, mandatory=True, timeout=self.confirm_timeout_s
        )
        if isinstance(answer, aiormq.abc.DeliveredMessage):  # returned: no queue took it
            raise BrokerError(f"RabbitMQ returned the copy: no queue {routing_key!r} to take it")


class RabbitMQDelivery(Delivery):
    """An AMQP delivery on a consumer channel, settled by its delivery tag on that channel."""

    def __init__(
        self,
        broker: RabbitMQBroker,
        received: Received,
        message: aiormq.abc.DeliveredMessage,
        tag: int,
        *,
        inbox: Inbox[Delivery],
        acks: _Acks,
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self._message = message
        self._tag = tag
        self._inbox = inbox
        self._acks = acks

    def _original_headers(self) -> dict[str, Any]:
        """The headers as the producer sent them, their AMQP types kept (bytes that are not
        UTF-8 included), without the broker's delivery count and idemq's attempt bookkeeping:
        what a copy of this message carries on."""
        headers = self._message.header.properties.headers or {}
        raw = {key: _amqp_value(value) for key, value in headers.items()}
        for name in ("x-delivery-count", ATTEMPT_HEADER, NOT_BEFORE_HEADER):
            raw.pop(name, None)
        return raw

    def _ack(self) -> Future[None]:
        return self._broker.settle_soon(self._mark_ack, hold=self._inbox.backlog())

    async def _mark_ack(self) -> None:
        self._acks.mark(self._tag)  # sent by the settler's confirm step, with its batch

    def _retry(self, delay_s: float, counted: bool) -> Future[None] | None:
        action = self._next_attempt if counted else self._requeue
        if delay_s <= 0 and not counted:
            return self._broker.settle_soon(action, hold=self._inbox.backlog())
        self._broker.settle_later(delay_s, action)
        return None

    async def _requeue(self) -> None:
        await self._acks.requeue(self._tag)

    async def _next_attempt(self) -> None:
        """The copy carrying the next attempt number (confirmed), then the original's ack."""
        headers: dict[str, Any] = self.retry_headers(counted=True)
        headers.update(self._original_headers())
        message_id = self.message.id if self.message else None
        try:
            await self._broker.publish_copy(self.queue, self.body, headers, message_id)
        except Exception:
            # Not lost: the original goes back as it is (this attempt number, tried again).
            log.exception("re-publishing %s for its next attempt failed; requeued", self.describe())
            await self._requeue()
            return
        await self._acks.ack_now(self._tag)

    def _copy_to_dead_letter(self, headers: dict[str, str]) -> None:
        # The producer's headers with their AMQP types, not their text forms.
        typed: dict[str, Any] = self._original_headers()
        typed.update((name, headers[name]) for name in DEAD_LETTER_HEADERS)
        message_id = self.message.id if self.message else None
        dlq = self._broker.dead_letter_queue(self.queue)
        self._broker.settle(self._broker.publish_copy(dlq, self.body, typed, message_id))
