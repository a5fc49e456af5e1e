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
import logging
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from idemq.brokers.settlement import Ack, Retry, Settlement
from idemq.drivers.urls import mask_url
from idemq.errors import (
    AlreadySettledError,
    BrokerError,
    ConfigurationError,
)
from idemq.message import BUSINESS_ID_HEADER, MESSAGE_ID_HEADER, Message

__all__ = [
    "ATTEMPT_HEADER",
    "DEAD_LETTER_ATTEMPTS_HEADER",
    "DEAD_LETTER_HEADERS",
    "DEAD_LETTER_QUEUE_HEADER",
    "DEAD_LETTER_REASON_HEADER",
    "Ack",
    "Broker",
    "Delivery",
    "NOT_BEFORE_HEADER",
    "Received",
    "Retry",
    "Settlement",
    "BROKER_MESSAGE_ID",
    "Traits",
    "check_declare_mode",
    "dead_letter_headers",
    "decode",
    "header_text",
    "mask_url",
    "settle_all",
    "split_query",
    "take_attempt",
]

DEAD_LETTER_REASON_HEADER = "idemq-dead-letter-reason"
DEAD_LETTER_QUEUE_HEADER = "idemq-original-queue"
DEAD_LETTER_ATTEMPTS_HEADER = "idemq-delivery-attempts"
# What a dead letter carries beside the original headers: why, from where, after how many tries.
DEAD_LETTER_HEADERS = (
    DEAD_LETTER_REASON_HEADER,
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_ATTEMPTS_HEADER,
)
# idemq's own attempt number, carried by the copy a counted retry re-publishes (see
# settlement.Retry), and when that copy is due. Adapters take both out of the headers they hand on.
ATTEMPT_HEADER = "idemq-delivery-attempt"
NOT_BEFORE_HEADER = "idemq-not-before-ms"

# A dead letter whose copy failed goes back to its queue for this long before it is tried again:
# the destination is often gone for a while (deleted, full), and at once would be a hot loop.
DEAD_LETTER_REQUEUE_S = 2.0

log = logging.getLogger("idemq.brokers")


def _count(text: str | None) -> int | None:
    """A non-negative integer written in ASCII digits (at most 18 of them), else None."""
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


def take_attempt(headers: dict[str, str]) -> tuple[int, int]:
    """Remove idemq's attempt and not-before headers from ``headers``; return
    ``(attempt, not_before_ms)``: attempt 1 and not-before 0 when absent or malformed."""
    attempt = _count(headers.pop(ATTEMPT_HEADER, None))
    not_before = _count(headers.pop(NOT_BEFORE_HEADER, None))
    return (attempt if attempt else 1), (not_before or 0)


# The name :func:`decode` gives the broker's own message id among ``undecodable`` ones.
BROKER_MESSAGE_ID = "the broker message id"


def header_text(value: object) -> tuple[str, bool]:
    """A header value as text, and whether it was text: ``str`` as it is, bytes decoded strictly
    as UTF-8 (when they are not valid UTF-8: replacement characters, and False), anything else
    (numbers, booleans, timestamps) as ``str()``."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8"), True
        except UnicodeDecodeError:
            return raw.decode("utf-8", "replace"), False
    return (value if isinstance(value, str) else str(value)), True


def decode(
    body: bytes,
    headers: Mapping[str, str],
    *,
    broker_message_id: str | None = None,
    delivery_attempt: int = 1,
    undecodable: Collection[str] = (),
) -> tuple[Message | None, str | None]:
    """Build the :class:`~idemq.Message` of a raw delivery, or say why it cannot be built.

    The id is the ``idemq-message-id`` header when the producer set one, else the broker's message
    id. The explicit header wins because some clients stamp a *random* broker id on every publish
    (aiormq does), which would make each producer retry look like a new message. Refused here: a
    *missing* id, and an id or business id that arrived as bytes that are not UTF-8
    (``undecodable`` names such headers, :data:`BROKER_MESSAGE_ID` the broker's id): made text
    with replacement characters, two different ids could become one key. The guard validates the
    rest (length, characters) in one place.
    """
    id_source = MESSAGE_ID_HEADER if headers.get(MESSAGE_ID_HEADER) else BROKER_MESSAGE_ID
    if id_source in undecodable:
        return None, f"InvalidMessageIdError: {id_source} is not valid UTF-8"
    if BUSINESS_ID_HEADER in undecodable:
        return None, f"InvalidBusinessIdError: {BUSINESS_ID_HEADER} is not valid UTF-8"
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


DECLARE_MODES = ("auto", "never")


def check_declare_mode(mode: object) -> str:
    """``auto``: adopt what exists, create only what is missing; ``never``: create nothing (a
    missing queue, stream or topic is a configuration error). What exists is never changed."""
    if mode not in DECLARE_MODES:
        raise ConfigurationError(f"declare must be 'auto' or 'never', got {mode!r}")
    return str(mode)


def split_query(url: str, names: Sequence[str]) -> tuple[str, dict[str, str]]:
    """``url`` without the query parameters ``names``, and their values (idemq's own options in
    a URL whose other parameters go to the client library)."""
    parts = urlsplit(url)
    kept, ours = [], {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in names:
            ours[key] = value
        else:
            kept.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), ours


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
class Traits:
    """What an adapter declares about itself (its class's ``TRAITS``), so that adding a broker
    touches its own module and one line of :data:`idemq.brokers.SCHEMES`, no other table.

    ``topology_options``: it takes ``?declare=`` and ``?dead_letter=`` (it has queues, streams
    or topics to declare). ``connect_timeout``: it takes ``?connect_timeout_ms=`` (its client's
    connect can outlast a short outage budget). ``redelivery_timers``: the URL query parameters
    that set how long an unsettled message stays away before the broker delivers it again, each
    with its unit's factor from seconds (none: the timer is the server's, not the client's).
    """

    topology_options: bool = False
    connect_timeout: bool = False
    redelivery_timers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Received:
    """The broker-independent part of a delivery, as every adapter builds it.

    ``delivery_attempt`` is idemq's attempt number (1 + the handler runs that failed before),
    ``not_before_ms`` when a re-published copy is due (0: now).
    """

    queue: str
    body: bytes
    headers: Mapping[str, str]
    message: Message | None
    decode_error: str | None
    delivery_attempt: int
    not_before_ms: int = 0

    @classmethod
    def build(
        cls,
        queue: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        broker_message_id: str | None = None,
        undecodable: Collection[str] = (),
    ) -> Received:
        """Decode ``body``/``headers`` (see :func:`decode`), keeping the raw parts either way.

        The attempt and not-before headers (:func:`take_attempt`) are taken out: they are
        idemq's bookkeeping, not the producer's headers. The broker's own delivery counter is
        not the attempt: it also counts outage and lease redeliveries (see ``Retry.counted``).
        """
        own = dict(headers)
        attempt, not_before_ms = take_attempt(own)
        message, error = decode(
            body,
            own,
            broker_message_id=broker_message_id,
            delivery_attempt=attempt,
            undecodable=undecodable,
        )
        return cls(queue, body, own, message, error, attempt, not_before_ms)


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
        self.not_before_ms = received.not_before_ms
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

    def retry(self, delay_s: float, *, counted: bool = False) -> Future[None]:
        """Have the broker deliver the message again after ``delay_s``.

        ``counted``: the handler ran and failed, so the redelivery is the next attempt
        (``delivery_attempt`` + 1, carried in :data:`ATTEMPT_HEADER` by a re-published copy);
        otherwise (an outage, a twin holding the lease) the redelivery keeps this attempt number.
        """
        self._mark("retry")
        return _future(self._retry(max(delay_s, 0.0), counted))

    def retry_headers(self, *, counted: bool, not_before_ms: int | None = None) -> dict[str, str]:
        """The headers of the copy a retry re-publishes: the original ones, the message id (so a
        copy never depends on a broker property), idemq's attempt number (bumped when
        ``counted``) and, when given, the time the copy is due."""
        out = dict(self.headers)
        if self.message is not None:
            out[MESSAGE_ID_HEADER] = self.message.id
        out[ATTEMPT_HEADER] = str(self.delivery_attempt + 1 if counted else self.delivery_attempt)
        if not_before_ms is not None:
            out[NOT_BEFORE_HEADER] = str(not_before_ms)
        return out

    def dead_letter(self, reason: str) -> Future[None]:
        """Move the message to the dead-letter destination with ``reason`` in its headers."""
        self._mark("dead_letter")
        return _future(self._dead_letter(reason))

    def dead_letter_copy_headers(self, reason: str) -> dict[str, str]:
        """The headers of the dead-letter copy: the original ones plus
        :data:`DEAD_LETTER_HEADERS`."""
        return dead_letter_headers(
            self.headers, reason=reason, queue=self.queue, delivery_attempt=self.delivery_attempt
        )

    def settle(self, settlement: Settlement) -> Future[None]:
        """Apply a decision of :func:`decide` (see :meth:`ack` for the future)."""
        if isinstance(settlement, Ack):
            return self.ack()
        if isinstance(settlement, Retry):
            return self.retry(settlement.delay_s, counted=settlement.counted)
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
    def _retry(self, delay_s: float, counted: bool) -> Future[None] | None: ...

    def _dead_letter(self, reason: str) -> Future[None] | None:
        """Copy to the dead-letter destination first, then settle the original; requeue it
        when the copy fails.

        The order is what keeps a poison message from being lost: a crash between the two
        steps leaves it in both places (dead-lettered twice, never lost), and a copy the broker
        did not confirm (a deleted or full destination, an outage) leaves the original to come
        back after :data:`DEAD_LETTER_REQUEUE_S`, rather than unsettled (holding a prefetch slot
        or a partition's commit for good) or acked (gone from both places). An adapter whose
        broker moves a message atomically overrides this (Redis Streams' MULTI, the embedded
        broker's one SQLite transaction).
        """
        try:
            self._copy_to_dead_letter(self.dead_letter_copy_headers(reason))
        except BrokerError as exc:
            log.warning(
                "dead-lettering %s failed, requeued: %s: %s",
                self.describe(),
                type(exc).__name__,
                exc,
            )
            return self._retry(DEAD_LETTER_REQUEUE_S, False)
        return self._drop_dead()

    def _drop_dead(self) -> Future[None] | None:
        """Settle the original once its dead-letter copy is confirmed: an ack, unless the broker
        has a settlement of its own for it (NATS' TERM)."""
        return self._ack()

    def _copy_to_dead_letter(self, headers: dict[str, str]) -> None:
        """Publish a copy of this message with ``headers`` to its dead-letter destination and
        wait for the broker's confirm; raise :class:`~idemq.errors.BrokerError` if it did not
        confirm. Every adapter that uses the :meth:`_dead_letter` template provides it."""
        raise NotImplementedError(f"{type(self).__name__} moves dead letters its own way")


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
