"""``nats://host:4222``: NATS JetStream through nats-py (on its own loop thread).

* A queue is the subject ``<queue>`` of the stream that captures it. **A stream that exists is
  used as it is** (whatever its name, subjects and settings: idemq never updates it). Only when
  no stream captures the subject does idemq create one (named after it, ``.`` → ``_``) with a
  ``duplicate_window``: publishes carry ``Nats-Msg-Id``, so a producer retry after a lost PubAck
  is dropped by the server itself (cause 1 of duplicates, absorbed before it reaches us).
  ``?declare=never``: nothing is created; a subject no stream captures is a
  :class:`~idemq.ConfigurationError`. ``?dead_letter=SUBJECT`` names the dead-letter subject.
* Consumers share one durable pull consumer (``group``) with explicit acks and ``ack_wait``:
  a consumer that dies without acking gets its messages redelivered after AckWait. The server's
  ``num_delivered`` is not the attempt number: it also counts outage and lease redeliveries.
* Retry after an outage or a busy lease = ``NAK`` with a delay (server-side timer; the attempt
  number stays). Retry after a failed handler run = publish a copy with
  ``idemq-delivery-attempt`` + 1 and ``idemq-not-before-ms`` (its ``Nats-Msg-Id`` is
  ``<id>#attempt-<n>``, so a crash and a second try publish it once), then ack the original;
  a copy fetched before it is due is NAKed with the time left. Ack = plain ``+ACK``, queued to
  the loop thread (:class:`~._aioloop.AckQueue`) with the others of its burst, then one
  ``flush()`` (PING/PONG): the PONG proves the server received every ack written before it, and a
  broken connection fails the whole burst, counted as settle failures. While messages of the
  last fetch are still to be handed out, acks are held and go out together before the next
  fetch (or every 100, or 50 ms after the oldest): one loop wake-up per fetch, not per message.
  Not ``ack_sync`` (a request/reply per message): its reply adds no safety — an ack lost anyway
  means a redelivery after AckWait, which the guard answers with DUPLICATE — and costs a round
  trip per message.
* Dead letter = publish to ``<queue>.dlq`` (stream ``<queue>_dlq``) with the reason headers,
  then ``TERM`` the message: JetStream stops redelivering it and emits its
  ``MSG_TERMINATED`` advisory. ``max_deliver`` is unlimited by default (``?max_deliver=N`` sets
  it): outage and in-progress redeliveries must not exhaust it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, StreamConfig

from idemq._clock import Clock, system_clock_ms
from idemq.brokers._aioloop import LoopBroker
from idemq.brokers.base import (
    ATTEMPT_HEADER,
    Delivery,
    Received,
    Traits,
    check_declare_mode,
    outgoing_headers,
)
from idemq.drivers.urls import mask_url
from idemq.errors import BrokerRefusedError, BrokerUnavailableError, ConfigurationError

__all__ = ["NatsBroker"]

NATS_MSG_ID = "Nats-Msg-Id"
log = logging.getLogger("idemq.brokers")

_DRIVER_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)


def stream_name(subject: str) -> str:
    """JetStream stream names may not contain ``.``, ``*``, ``>`` or spaces."""
    return "".join("_" if ch in ".*> " else ch for ch in subject)


class NatsBroker(LoopBroker):
    """JetStream streams as queues; one durable pull consumer per queue."""

    TRAITS: ClassVar[Traits] = Traits(
        topology_options=True, connect_timeout=True, redelivery_timers=(("ack_wait_s", 1),)
    )

    def __init__(
        self,
        url: str,
        *,
        group: str = "idemq",
        ack_wait_s: float = 30.0,
        max_deliver: int = -1,
        duplicate_window_s: float = 120.0,
        timeout_s: float = 10.0,
        declare: str = "auto",
        dead_letter: str | None = None,
        connect_timeout_s: float | None = None,
        clock_ms: Clock = system_clock_ms,
    ) -> None:
        self.clock_ms = clock_ms
        self.url = url
        self.declare_mode = check_declare_mode(declare)
        self.dead_letter = dead_letter
        self._streams: dict[str, str] = {}  # subject → the stream that captures it
        self.group = group
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.duplicate_window_s = duplicate_window_s
        self.timeout_s = timeout_s
        super().__init__(
            "NATS",
            driver_errors=_DRIVER_ERRORS,
            call_timeout_s=timeout_s + 5,
            confirm=lambda: self._nc.flush(timeout_s),
        )
        self._last_error: Exception | None = None
        self._connected = False
        try:
            # nats-py keeps retrying a refused connect; wait_for ends it inside the loop, so the
            # task is cancelled and awaited there rather than left pending when the loop stops.
            # nats-py takes whole seconds: a sub-second timeout must not become 0 (no time at all).
            # connect_timeout_s: a worker's outage budget (--give-up-after) bounds one attempt.
            wait_s = timeout_s if connect_timeout_s is None else min(connect_timeout_s, timeout_s)
            connect = nats.connect(
                url, connect_timeout=max(1, math.ceil(wait_s)), error_cb=self._on_error
            )
            self._nc = self._call(asyncio.wait_for(connect, wait_s))
        except BrokerUnavailableError as exc:
            self._loop.stop()
            raise self._refusal(exc) from exc
        self._connected = True
        self._js = self._nc.jetstream(timeout=timeout_s)

    async def _on_error(self, error: Exception) -> None:
        # nats-py reports every failed attempt here (by default with a traceback each). While
        # connecting, the worker's one line per attempt says it; once running, one line here.
        self._last_error = error
        level = logging.WARNING if self._connected else logging.DEBUG
        log.log(level, "NATS %s: %s: %s", mask_url(self.url), type(error).__name__, error)

    def _refusal(self, exc: BrokerUnavailableError) -> Exception:
        """What a failed connect was: a refused authorization is a configuration error (no
        retry helps), anything else an outage, named by the client's last error."""
        last = self._last_error
        if isinstance(last, nats.errors.AuthorizationError):
            return ConfigurationError(
                f"NATS refused the connection to {mask_url(self.url)}: {last}"
            )
        if last is None:
            return exc
        return BrokerUnavailableError(
            f"NATS: cannot connect to {mask_url(self.url)}: {type(last).__name__}: {last}"
        )

    @classmethod
    def from_url(cls, url: str) -> NatsBroker:
        """``nats://host:4222?ack_wait_s=30&max_deliver=-1&group=idemq`` (also
        ``connect_timeout_ms``: how long a connect is waited for, at most and by default 10000)."""
        parts = urlsplit(url)
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        plain = urlunsplit(parts._replace(query=""))
        try:
            return cls(
                plain,
                group=query.get("group", "idemq"),
                ack_wait_s=float(query.get("ack_wait_s", "30")),
                max_deliver=int(query.get("max_deliver", "-1")),
                duplicate_window_s=float(query.get("duplicate_window_s", "120")),
                declare=query.get("declare", "auto"),
                dead_letter=query.get("dead_letter"),
                connect_timeout_s=(
                    float(query["connect_timeout_ms"]) / 1000
                    if "connect_timeout_ms" in query
                    else None
                ),
            )
        except ValueError as exc:
            raise ConfigurationError(f"bad number in NATS URL {url!r}") from exc

    def dead_letter_queue(self, queue: str) -> str:
        """``dead_letter`` if given, else subject ``<queue>.dlq`` (stream ``<queue>_dlq`` when
        idemq creates it)."""
        return self.dead_letter or f"{queue}.dlq"

    async def _declare(self, subject: str) -> str:
        """The stream capturing ``subject``: the one that exists, else one made for it."""
        if subject in self._streams:
            return self._streams[subject]
        stream = await self._captured_by(subject)
        if stream is None:
            if self.declare_mode == "never":
                raise ConfigurationError(
                    f"no JetStream stream captures subject {subject!r}"
                    " (declare=never: idemq creates nothing)"
                )
            stream = stream_name(subject)
            config = StreamConfig(
                name=stream, subjects=[subject], duplicate_window=self.duplicate_window_s
            )
            try:
                await self._js.add_stream(config)
            except nats.js.errors.BadRequestError as exc:
                # Made meanwhile by another worker with the same config is not an error; a name
                # taken by a stream of other subjects, or subjects overlapping another's, is.
                if await self._captured_by(subject) != stream:
                    raise ConfigurationError(
                        f"cannot create JetStream stream {stream!r} for {subject!r}: {exc}"
                    ) from exc
        self._streams[subject] = stream
        return stream

    async def _captured_by(self, subject: str) -> str | None:
        try:
            name: str = await self._js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return None
        return name

    def declare(self, queue: str) -> None:
        """Adopt the streams capturing the queue's subject and its dead-letter subject,
        creating one for a subject no stream captures."""

        async def both() -> None:
            await self._declare(queue)
            await self._declare(self.dead_letter_queue(queue))

        self._call(both())

    def delete_queue(self, queue: str) -> None:
        """Delete both streams (and with them the durable consumers)."""

        async def both() -> None:
            for subject in (queue, self.dead_letter_queue(queue)):
                self._streams.pop(subject, None)
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self._js.delete_stream(stream_name(subject))

        self._call(both())

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Publish with ``Nats-Msg-Id`` (server-side dedup window) and wait for the PubAck.

        A subject no stream captures, a body over the server's ``max_payload`` and a message the
        stream answers with a 4xx error (over its ``max_msg_size``, say) raise
        :class:`~idemq.errors.BrokerRefusedError`: the same publish would meet the same answer.
        """
        all_headers = outgoing_headers(headers, message_id)
        if message_id is not None:
            all_headers[NATS_MSG_ID] = message_id

        async def acked() -> None:
            try:
                await self._js.publish(queue, body, headers=all_headers or None)
            except nats.errors.MaxPayloadError as exc:
                raise BrokerRefusedError(
                    f"NATS: {len(body)} bytes to {queue!r} is over the server's max_payload"
                    f" ({self._nc.max_payload} bytes)"
                ) from exc
            except nats.js.errors.NoStreamResponseError as exc:
                # "No responders" also answers while JetStream is not there at all (a server
                # restarting): a refusal only when the server says no stream has the subject.
                if await self._captured_by(queue) is None:
                    raise BrokerRefusedError(
                        f"NATS: no JetStream stream captures the subject {queue!r}"
                    ) from exc
                raise
            except nats.js.errors.APIError as exc:
                if isinstance(exc.code, int) and 400 <= exc.code < 500:
                    raise BrokerRefusedError(f"NATS JetStream refused {queue!r}: {exc}") from exc
                raise

        self._call(acked())

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Fetch up to ``prefetch`` messages per round trip from the durable pull consumer."""
        self.declare(queue)
        durable = f"{self.group}_{stream_name(queue)}"
        config = ConsumerConfig(
            durable_name=durable,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            filter_subject=queue,
        )
        subscription = self._call(
            self._js.pull_subscribe(queue, durable, stream=self._streams[queue], config=config)
        )

        async def fetch() -> list[Msg]:
            try:
                messages: list[Msg] = await subscription.fetch(prefetch, timeout=0.2)
            except TimeoutError:  # nats.errors.TimeoutError is one too
                # nats-py also raises a plain (asyncio) TimeoutError when a pull for several
                # messages expires (seen once messages were NAKed with a delay): nothing came.
                return []
            return messages

        try:
            while True:
                self._settler.flush()  # the acks held during the last fetch's messages
                messages = self._call(fetch())
                if not messages:
                    yield None
                backlog = _Backlog(len(messages))
                for message in messages:
                    backlog.left -= 1
                    delivery = self._delivery(queue, message, backlog)
                    early_s = (delivery.not_before_ms - self.clock_ms()) / 1000
                    if early_s > 0:
                        delivery.retry(early_s)  # a copy not yet due: no handler run, no attempt
                        continue
                    yield delivery
        finally:
            self._settler.flush()

    def _delivery(self, queue: str, message: Msg, backlog: _Backlog) -> NatsDelivery:
        headers = dict(message.headers or {})
        received = Received.build(
            queue, message.data, headers, broker_message_id=headers.get(NATS_MSG_ID)
        )
        return NatsDelivery(self, received, message, backlog)

    def close(self) -> None:
        """Send the queued acks, then close the connection; unacked messages come back after
        AckWait."""
        try:
            self._settler.drain(self.timeout_s + 5)
            self._call(self._nc.close())
        except BrokerUnavailableError:
            pass
        finally:
            self._loop.stop()

    # used by NatsDelivery ----------------------------------------------------------------------

    async def publish_copy(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        """Publish to ``subject`` and wait for the PubAck (runs on the loop)."""
        await self._js.publish(subject, body, headers=headers)


class _Backlog:
    """How many messages of one fetch the consumer has yet to hand out."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left


class NatsDelivery(Delivery):
    """A JetStream message from a pull consumer."""

    def __init__(
        self, broker: NatsBroker, received: Received, message: Msg, backlog: _Backlog
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self._message = message
        self._backlog = backlog

    def _ack(self) -> Future[None]:
        return self._broker.settle_soon(self._message.ack, hold=self._backlog.left > 0)

    def _retry(self, delay_s: float, counted: bool) -> Future[None] | None:
        if not counted:
            return self._broker.settle_soon(
                lambda: self._message.nak(delay=delay_s or None), hold=self._backlog.left > 0
            )
        not_before_ms = self._broker.clock_ms() + int(delay_s * 1000)
        headers = self.retry_headers(counted=True, not_before_ms=not_before_ms)
        if self.message is not None:
            headers[NATS_MSG_ID] = f"{self.message.id}#attempt-{headers[ATTEMPT_HEADER]}"

        async def next_attempt() -> None:
            # The copy first (PubAck), then the ack: a crash between leaves the original, whose
            # next failure publishes the same Nats-Msg-Id again, which the server drops.
            await self._broker.publish_copy(self.queue, self.body, headers)
            await self._message.ack()

        self._broker.settle(next_attempt())
        return None

    def _drop_dead(self) -> Future[None]:
        # TERM, not ACK: JetStream publishes its terminated advisory for the dead letter.
        return self._broker.settle_soon(self._message.term, hold=self._backlog.left > 0)

    def _copy_to_dead_letter(self, headers: dict[str, str]) -> None:
        # Not the original Nats-Msg-Id: the DLQ stream's dedup window would drop a second
        # dead letter of the same id (e.g. a re-published poison message), hiding it.
        headers.pop(NATS_MSG_ID, None)
        dlq = self._broker.dead_letter_queue(self.queue)
        self._broker.settle(self._broker.publish_copy(dlq, self.body, headers))
