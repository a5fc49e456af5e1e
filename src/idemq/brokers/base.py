"""What every broker adapter offers: a consumer of :class:`Delivery` objects, each settled once.

An adapter turns its broker's at-least-once delivery into an iterator of :class:`Delivery`
objects (``None`` when idle, so the worker can notice a stop request — dramatiq's consumer
shape). The worker runs the guard and then settles each delivery exactly once, as
:func:`idemq.brokers.settlement.decide` says; a second settlement raises
:class:`~idemq.errors.AlreadySettledError` instead of being dropped silently.

Settling returns a :class:`~concurrent.futures.Future`: adapters whose client lives on another
thread (RabbitMQ, NATS) queue acks instead of waiting for each one, and report a failure through
it. :func:`settle_all` settles many deliveries at once, so an adapter can group them (Redis
Streams: one ``XACK`` for a whole batch); the default settles them one by one.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from idemq.brokers.settlement import Ack, Retry, Settlement
from idemq.drivers.urls import mask_url
from idemq.errors import (
    AlreadySettledError,
    BrokerError,
)
from idemq.message import BUSINESS_ID_HEADER, MESSAGE_ID_HEADER, Message

__all__ = [
    "DEAD_LETTER_ATTEMPTS_HEADER",
    "DEAD_LETTER_QUEUE_HEADER",
    "DEAD_LETTER_REASON_HEADER",
    "Ack",
    "Broker",
    "Delivery",
    "Received",
    "Retry",
    "Settlement",
    "dead_letter_headers",
    "decode",
    "mask_url",
    "settle_all",
]

DEAD_LETTER_REASON_HEADER = "idemq-dead-letter-reason"
DEAD_LETTER_QUEUE_HEADER = "idemq-original-queue"
DEAD_LETTER_ATTEMPTS_HEADER = "idemq-delivery-attempts"


def decode(
    body: bytes,
    headers: Mapping[str, str],
    *,
    broker_message_id: str | None = None,
    delivery_attempt: int = 1,
) -> tuple[Message | None, str | None]:
    """Build the :class:`~idemq.Message` of a raw delivery, or say why it cannot be built.

    The id is the ``idemq-message-id`` header when the producer set one, else the broker's message
    id. The explicit header wins because some clients stamp a *random* broker id on every publish
    (aiormq does), which would make each producer retry look like a new message. Only a
    *missing* id is refused here; the guard validates the rest (length, characters) in one place.
    """
    message_id = headers.get(MESSAGE_ID_HEADER) or broker_message_id
    if not message_id:
        return None, f"no message id (neither a broker message id nor {MESSAGE_ID_HEADER})"
    message = Message(
        id=message_id,
        body=body,
        headers=dict(headers),
        business_id=headers.get(BUSINESS_ID_HEADER) or None,
        delivery_attempt=delivery_attempt,
    )
    return message, None


def outgoing_headers(headers: Mapping[str, str] | None, message_id: str | None) -> dict[str, str]:
    """The headers a publish sends: the caller's, plus ``idemq-message-id`` when an id is given
    (every adapter carries the id in this header, whatever else the broker offers)."""
    out = dict(headers or {})
    if message_id is not None:
        out[MESSAGE_ID_HEADER] = message_id
    return out


def dead_letter_headers(
    headers: Mapping[str, str], *, reason: str, queue: str, delivery_attempt: int
) -> dict[str, str]:
    """The original headers plus why, from where and after how many attempts it died."""
    out = dict(headers)
    out[DEAD_LETTER_REASON_HEADER] = reason[:1000]
    out[DEAD_LETTER_QUEUE_HEADER] = queue
    out[DEAD_LETTER_ATTEMPTS_HEADER] = str(delivery_attempt)
    return out


@dataclass(frozen=True, slots=True)
class Received:
    """The broker-independent part of a delivery, as every adapter builds it."""

    queue: str
    body: bytes
    headers: Mapping[str, str]
    message: Message | None
    decode_error: str | None
    delivery_attempt: int

    @classmethod
    def build(
        cls,
        queue: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        broker_message_id: str | None = None,
        delivery_attempt: int = 1,
    ) -> Received:
        """Decode ``body``/``headers`` (see :func:`decode`), keeping the raw parts either way."""
        message, error = decode(
            body, headers, broker_message_id=broker_message_id, delivery_attempt=delivery_attempt
        )
        return cls(queue, body, dict(headers), message, error, delivery_attempt)


class Delivery(abc.ABC):
    """One received message and the way to settle it — exactly once.

    ``message`` is ``None`` when the raw delivery could not be decoded; then ``decode_error``
    says why and the worker dead-letters it (the raw ``body``/``headers`` are kept for that).
    """

    def __init__(self, received: Received) -> None:
        self.queue = received.queue
        self.body = received.body
        self.headers = dict(received.headers)
        self.message = received.message
        self.decode_error = received.decode_error
        self.delivery_attempt = received.delivery_attempt
        self._settled_as: str | None = None
        self._lock = threading.Lock()

    @property
    def settled(self) -> bool:
        """Whether ack, retry or dead_letter has been called."""
        return self._settled_as is not None

    def ack(self) -> Future[None]:
        """Acknowledge: the broker forgets the message.

        The future is done once the broker client has sent the ack — at once for most adapters;
        later for those that queue acks (their ``close()`` sends what is queued). It carries the
        :class:`~idemq.errors.BrokerError` when the ack failed (the broker then redelivers).
        """
        self._mark("ack")
        return _future(self._ack())

    def retry(self, delay_s: float) -> Future[None]:
        """Leave the message unacknowledged so the broker delivers it again after ``delay_s``."""
        self._mark("retry")
        return _future(self._retry(max(delay_s, 0.0)))

    def dead_letter(self, reason: str) -> Future[None]:
        """Move the message to the dead-letter destination with ``reason`` in its headers."""
        self._mark("dead_letter")
        return _future(self._dead_letter(reason))

    def settle(self, settlement: Settlement) -> Future[None]:
        """Apply a decision of :func:`decide` (see :meth:`ack` for the future)."""
        if isinstance(settlement, Ack):
            return self.ack()
        if isinstance(settlement, Retry):
            return self.retry(settlement.delay_s)
        return self.dead_letter(settlement.reason)

    @classmethod
    def settle_group(cls, pairs: Sequence[tuple[Delivery, Settlement]]) -> list[Future[None]]:
        """Settle deliveries of this class; an adapter overrides this to group them into fewer
        round trips. A failure fails only its own future, the others are still settled."""
        return [_attempt(delivery, settlement) for delivery, settlement in pairs]

    def _mark(self, how: str) -> None:
        with self._lock:
            if self._settled_as is not None:
                raise AlreadySettledError(
                    f"delivery of {self.describe()} already settled by {self._settled_as}"
                )
            self._settled_as = how

    def describe(self) -> str:
        """A short label for logs: the message id or the decode error."""
        return repr(self.message.id) if self.message else f"<undecodable: {self.decode_error}>"

    # Each returns None when done, or a future when the adapter finishes it later.

    @abc.abstractmethod
    def _ack(self) -> Future[None] | None: ...

    @abc.abstractmethod
    def _retry(self, delay_s: float) -> Future[None] | None: ...

    @abc.abstractmethod
    def _dead_letter(self, reason: str) -> Future[None] | None: ...


def settle_all(pairs: Sequence[tuple[Delivery, Settlement]]) -> list[Future[None]]:
    """Settle each delivery as paired, grouped per adapter (:meth:`Delivery.settle_group`);
    one future per pair, in order. Broker errors land in the futures, never raised."""
    futures: list[Future[None]] = [_DONE] * len(pairs)
    groups: dict[type[Delivery], list[int]] = {}
    for i, (delivery, _) in enumerate(pairs):
        groups.setdefault(type(delivery), []).append(i)
    for kind, positions in groups.items():
        settled = kind.settle_group([pairs[i] for i in positions])
        for i, future in zip(positions, settled, strict=True):
            futures[i] = future
    return futures


def _failed(error: BaseException) -> Future[None]:
    """A future that already holds ``error``."""
    future: Future[None] = Future()
    future.set_exception(error)
    return future


def _attempt(delivery: Delivery, settlement: Settlement) -> Future[None]:
    try:
        return delivery.settle(settlement)
    except BrokerError as exc:
        return _failed(exc)


def _future(pending: Future[None] | None) -> Future[None]:
    return _DONE if pending is None else pending


_DONE: Future[None] = Future()
_DONE.set_result(None)  # shared: a done future is never changed again


@runtime_checkable
class Broker(Protocol):
    """A connection to one broker; thread-safe settlement, one consumer iterator at a time."""

    def declare(self, queue: str) -> None:
        """Make ``queue`` and its dead-letter destination exist, so messages published from now
        on are kept even before a consumer runs (idempotent)."""
        ...

    def consume(self, queue: str, *, prefetch: int) -> Iterator[Delivery | None]:
        """Deliveries from ``queue``; ``None`` whenever nothing arrived for a short while.

        Closing the iterator only stops receiving: deliveries already handed out can still be
        settled until :meth:`close` (so a graceful stop can ack what is in flight).
        """
        ...

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Send one message and wait for the broker to confirm it."""
        ...

    def dead_letter_queue(self, queue: str) -> str:
        """Where dead letters of ``queue`` go (readable with :meth:`consume`)."""
        ...

    def delete_queue(self, queue: str) -> None:
        """Remove ``queue`` and its dead-letter destination with their messages (tests, tools)."""
        ...

    def close(self) -> None:
        """Close the connection; unsettled deliveries will be redelivered by the broker."""
        ...
