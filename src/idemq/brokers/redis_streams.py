"""``redis://host:6379/0``: Redis Streams with a consumer group (redis-py, synchronous).

* One stream per queue; entries carry ``id`` (the message id), ``body`` and ``headers`` (JSON).
* Consumers read with ``XREADGROUP``; an entry stays in the group's pending list until XACK.
* A consumer that died leaves its entries pending: every poll first runs ``XAUTOCLAIM`` for
  entries idle longer than ``claim_idle_ms``, so they are redelivered to a live consumer (the
  delivery counter Redis keeps is not the attempt number: it counts outage redeliveries too).
* Retry after an outage or a busy lease: the entry stays pending, and ``XCLAIM … IDLE`` rewinds
  its idle time so XAUTOCLAIM picks it up after ``delay_s`` (the attempt number stays).
  Retry after a failed handler run: ``XADD`` a copy with ``idemq-delivery-attempt`` + 1 and
  ``idemq-not-before-ms``, and ``XACK`` the original, in one MULTI/EXEC; a copy read before it
  is due is put back the first way, for the time left.
* Dead letter: ``XADD <stream>.dlq`` and ``XACK`` in one MULTI/EXEC — moved, never lost nor
  duplicated. On a Redis Cluster a MULTI can only touch one hash slot: a queue named with a
  hash tag (``{orders}``, whose dead letters go to ``{orders}.dlq``) keeps the move atomic;
  for any other name the XADD comes first and the XACK second, so a crash in between leaves
  the entry pending and it may reach the dead-letter stream twice, never zero times.
* Cluster: ``redis://host:port?cluster=true`` (or a ``redis.cluster.RedisCluster`` passed in);
  every command of a queue is on one stream key, so redis-py routes it to that key's master.
* Acks are held and sent together: one ``XACK`` per stream with every held entry id, before the
  next read, once ``ACK_BATCH`` are held (a batch's acks at once) and on ``close()`` — one round
  trip instead of one per message. An ack held when the process dies is a pending entry like
  any unacked one: XAUTOCLAIM redelivers it and the guard answers DUPLICATE.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
import redis.exceptions as rx

from idemq._clock import Clock, system_clock_ms
from idemq.brokers.base import (
    BROKER_MESSAGE_ID,
    Delivery,
    Received,
    Traits,
    check_declare_mode,
    header_text,
)
from idemq.brokers.settlement import Ack, Settlement
from idemq.drivers.redis import AnyRedis, is_cluster, key_slot, redis_client
from idemq.drivers.urls import mask_url
from idemq.errors import BrokerRefusedError, BrokerUnavailableError, ConfigurationError

__all__ = ["RedisStreamsBroker"]

# Cannot reach the server, or (Cluster) its slot is moving or has no master yet: retry later.
_DRIVER_ERRORS = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterDownError,
    rx.TryAgainError,
    rx.AskError,
    rx.ClusterError,
    rx.SlotNotCoveredError,
)

# Held acks go out once this many are held, if no read came first (a batch of 100: at once).
ACK_BATCH = 100


class RedisStreamsBroker:
    """Streams as queues, one consumer group (``group``) per queue."""

    TRAITS: ClassVar[Traits] = Traits(
        topology_options=True, redelivery_timers=(("claim_idle_ms", 1000),)
    )

    def __init__(
        self,
        client: AnyRedis,
        *,
        group: str = "idemq",
        claim_idle_ms: int = 30_000,
        block_ms: int = 200,
        declare: str = "auto",
        dead_letter: str | None = None,
        clock_ms: Clock = system_clock_ms,
    ) -> None:
        self.client = client
        self.clock_ms = clock_ms
        self.group = group
        self.declare_mode = check_declare_mode(declare)
        self.dead_letter = dead_letter
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = block_ms
        self._held: list[tuple[str, list[bytes], Future[None]]] = []  # acks not sent yet
        self._held_count = 0
        self._held_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> RedisStreamsBroker:
        """``redis://host:port/db?group=idemq&claim_idle_ms=30000`` (``&cluster=true``: a Redis
        Cluster reached through that node; ``declare=auto|never`` and ``dead_letter=STREAM``:
        see :meth:`declare`)."""
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        try:
            claim_idle_ms = int(query.pop("claim_idle_ms", ["30000"])[0])
        except ValueError as exc:
            raise ConfigurationError(
                f"claim_idle_ms must be an integer in {mask_url(url)}"
            ) from exc
        group = query.pop("group", ["idemq"])[0]
        declare = query.pop("declare", ["auto"])[0]
        dead_letter = query.pop("dead_letter", [None])[0]
        rest = "&".join(f"{key}={values[0]}" for key, values in query.items())
        client = redis_client(urlunsplit(parts._replace(query=rest)), redis.Redis)
        return cls(
            client,
            group=group,
            claim_idle_ms=claim_idle_ms,
            declare=declare,
            dead_letter=dead_letter,
        )

    def dead_letter_queue(self, queue: str) -> str:
        """The stream ``dead_letter`` if given, else ``<queue>.dlq``."""
        return self.dead_letter or f"{queue}.dlq"

    def declare(self, queue: str) -> None:
        """Adopt the stream and the consumer group as they are, creating only what is missing
        (a new group reads from the start: nothing published is missed). With
        ``declare=never`` nothing is created: the stream and its group must exist, else a
        :class:`~idemq.ConfigurationError` names what is missing (the dead-letter stream is
        made by its first ``XADD``, as any stream)."""
        if self.declare_mode == "never":
            self._require_group(queue)
            return
        for stream in (queue, self.dead_letter_queue(queue)):
            try:
                self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise BrokerUnavailableError(f"Redis: cannot create group: {exc}") from exc
            except _DRIVER_ERRORS as exc:
                raise BrokerUnavailableError(f"Redis: {exc}") from exc

    def _require_group(self, queue: str) -> None:
        try:
            groups = self.client.xinfo_groups(queue)
        except redis.exceptions.ResponseError as exc:  # no such key
            raise ConfigurationError(
                f"Redis stream {queue!r} does not exist (declare=never: idemq creates nothing)"
            ) from exc
        except _DRIVER_ERRORS as exc:
            raise BrokerUnavailableError(f"Redis: {exc}") from exc
        names = {header_text(group["name"])[0] for group in groups}
        if self.group not in names:
            raise ConfigurationError(
                f"Redis stream {queue!r} has no consumer group {self.group!r}"
                " (declare=never: idemq creates nothing; ?group=NAME names an existing one)"
            )

    def delete_queue(self, queue: str) -> None:
        """Delete the stream and its dead-letter stream."""
        self._call(self.client.delete, queue, self.dead_letter_queue(queue))

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """``XADD`` one entry (acknowledged by Redis when this returns).

        Redis refusing the command (``queue`` is a key of another type, say) raises
        :class:`~idemq.errors.BrokerRefusedError`; a server out of memory or read-only (a
        replica during a failover) is an outage, :class:`~idemq.errors.BrokerUnavailableError`.
        """
        try:
            self._call(self.client.xadd, queue, _fields(body, headers or {}, message_id))
        except (rx.OutOfMemoryError, rx.ReadOnlyError) as exc:
            raise BrokerUnavailableError(f"Redis: {type(exc).__name__}: {exc}") from exc
        except rx.ResponseError as exc:
            raise BrokerRefusedError(f"Redis refused XADD to {queue!r}: {exc}") from exc

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Reclaim idle pending entries first, then read new ones (``prefetch`` per round trip)."""
        self.declare(queue)
        consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        while True:
            self.send_acks()  # before reading: XAUTOCLAIM must not hand back what is done
            deliveries = self._claim_idle(queue, consumer, prefetch)
            if not deliveries:
                deliveries = self._read_new(queue, consumer, prefetch)
            if not deliveries:
                yield None
            for delivery in deliveries:
                early_s = (delivery.not_before_ms - self.clock_ms()) / 1000
                if early_s > 0:
                    delivery.retry(early_s)  # a copy not yet due: no handler run, no attempt
                    continue
                yield delivery

    def close(self) -> None:
        """Send the held acks, close the connection pool; pending entries are reclaimed by other
        consumers."""
        try:
            self.send_acks()
        finally:
            self.client.close()

    def ack_entries(self, queue: str, entry_ids: list[bytes]) -> Future[None]:
        """Hold the acks of ``entry_ids`` (see the module doc); the future completes when
        :meth:`send_acks` sent them, with the error if that failed."""
        future: Future[None] = Future()
        with self._held_lock:
            self._held.append((queue, entry_ids, future))
            self._held_count += len(entry_ids)
            full = self._held_count >= ACK_BATCH
        if full:
            self.send_acks()
        return future

    def send_acks(self) -> None:
        """``XACK`` every held entry, one command per stream; never raises (see the futures)."""
        with self._held_lock:
            held, self._held, self._held_count = self._held, [], 0
        streams: dict[str, list[tuple[list[bytes], Future[None]]]] = {}
        for queue, entry_ids, future in held:
            streams.setdefault(queue, []).append((entry_ids, future))
        for queue, acks in streams.items():
            entry_ids = [entry_id for ids, _ in acks for entry_id in ids]
            try:
                self._call(self.client.xack, queue, self.group, *entry_ids)
            except BrokerUnavailableError as exc:
                for _, future in acks:
                    future.set_exception(exc)
            else:
                for _, future in acks:
                    future.set_result(None)

    # -- internals ---------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _DRIVER_ERRORS as exc:
            raise BrokerUnavailableError(f"Redis: {type(exc).__name__}: {exc}") from exc

    def _claim_idle(self, queue: str, consumer: str, count: int) -> list[Delivery]:
        reply = self._call(
            self.client.xautoclaim, queue, self.group, consumer, self.claim_idle_ms, "0-0", count
        )
        return [
            self._delivery(queue, consumer, entry_id, fields)
            for entry_id, fields in reply[1]
            if fields
        ]

    def _read_new(self, queue: str, consumer: str, count: int) -> list[Delivery]:
        reply = self._call(
            self.client.xreadgroup,
            self.group,
            consumer,
            {queue: ">"},
            count=count,
            block=self.block_ms,
        )
        if not reply:
            return []
        return [
            self._delivery(queue, consumer, entry_id, fields) for entry_id, fields in reply[0][1]
        ]

    def _delivery(
        self, queue: str, consumer: str, entry_id: bytes, fields: dict[bytes, bytes]
    ) -> RedisStreamsDelivery:
        body = fields.get(b"body", b"")
        try:
            headers = {str(k): str(v) for k, v in json.loads(fields.get(b"headers", b"{}")).items()}
        except (ValueError, AttributeError):
            headers = {}
        raw_id = fields.get(b"id")
        broker_id, is_text = header_text(raw_id) if raw_id else (None, True)
        received = Received.build(
            queue,
            body,
            headers,
            broker_message_id=broker_id,
            undecodable=() if is_text else (BROKER_MESSAGE_ID,),
        )
        return RedisStreamsDelivery(self, received, entry_id=entry_id, consumer=consumer)


def _fields(body: bytes, headers: Mapping[str, str], message_id: str | None) -> dict[Any, Any]:
    fields: dict[Any, Any] = {"body": body, "headers": json.dumps(dict(headers))}
    if message_id is not None:
        fields["id"] = message_id
    return fields


class RedisStreamsDelivery(Delivery):
    """A pending entry of a consumer group."""

    def __init__(
        self, broker: RedisStreamsBroker, received: Received, *, entry_id: bytes, consumer: str
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self._entry_id = entry_id
        self._consumer = consumer

    @classmethod
    def settle_group(cls, pairs: Sequence[tuple[Delivery, Settlement]]) -> list[Future[None]]:
        """The acks of one stream held together; retries and dead letters one by one."""
        futures: dict[int, Future[None]] = {}
        acks: dict[tuple[RedisStreamsBroker, str], list[tuple[int, RedisStreamsDelivery]]] = {}
        for i, (delivery, settlement) in enumerate(pairs):
            if isinstance(settlement, Ack) and isinstance(delivery, RedisStreamsDelivery):
                delivery._mark("ack")
                acks.setdefault((delivery._broker, delivery.queue), []).append((i, delivery))
            else:
                futures[i] = super().settle_group([(delivery, settlement)])[0]
        for (broker, queue), group in acks.items():
            future = broker.ack_entries(queue, [delivery._entry_id for _, delivery in group])
            futures.update((i, future) for i, _ in group)
        return [futures[i] for i in range(len(pairs))]

    def _ack(self) -> Future[None]:
        return self._broker.ack_entries(self.queue, [self._entry_id])

    def _retry(self, delay_s: float, counted: bool) -> None:
        b = self._broker
        if counted:
            not_before_ms = b.clock_ms() + int(delay_s * 1000)
            headers = self.retry_headers(counted=True, not_before_ms=not_before_ms)
            message_id = self.message.id if self.message else None
            pipe = b.client.pipeline(transaction=True)  # MULTI/EXEC: the copy replaces it
            pipe.xadd(self.queue, _fields(self.body, headers, message_id))
            pipe.xack(self.queue, b.group, self._entry_id)
            b._call(pipe.execute)
            return
        idle_ms = max(b.claim_idle_ms - int(delay_s * 1000), 0)
        b._call(
            b.client.xclaim,
            self.queue,
            b.group,
            self._consumer,
            0,
            [self._entry_id],
            idle=idle_ms,
            justid=True,
        )

    def _dead_letter(self, reason: str) -> Future[None] | None:
        b = self._broker
        dlq = b.dead_letter_queue(self.queue)
        if is_cluster(b.client) and key_slot(dlq) != key_slot(self.queue):
            # Two slots, two masters: no MULTI spans them, so copy first, then ack.
            return super()._dead_letter(reason)
        pipe = b.client.pipeline(transaction=True)  # MULTI/EXEC: move atomically
        pipe.xadd(dlq, self._dead_letter_fields(self.dead_letter_copy_headers(reason)))
        pipe.xack(self.queue, b.group, self._entry_id)
        b._call(pipe.execute)
        return None

    def _copy_to_dead_letter(self, headers: dict[str, str]) -> None:
        b = self._broker
        b._call(b.client.xadd, b.dead_letter_queue(self.queue), self._dead_letter_fields(headers))

    def _dead_letter_fields(self, headers: dict[str, str]) -> dict[Any, Any]:
        return _fields(self.body, headers, self.message.id if self.message else None)
