"""``kafka://host:9092``: Kafka (or Tansu) through confluent-kafka, synchronous.

Kafka has offsets, not per-message acks, so settlement is built on top:

* **Commit only after settlement, only contiguously.** A partition's offset is committed up to
  the first delivery not yet settled; a consumer that dies re-reads everything after it (the
  guard turns what was already done into DUPLICATEs). Commits run on the consuming thread,
  without waiting for the broker's answer (a later commit covers a failed one), except the last
  one before the consumer leaves the group, which waits and names the point of every partition
  it holds (see :class:`_Offsets`).
* **Retry** = re-publish a copy to the same topic with ``idemq-not-before-ms`` = now + delay and
  ``idemq-delivery-attempt`` (+ 1 after a failed handler run only: a store outage or a busy
  lease keeps the number, so it never dead-letters), then count the original as settled. The
  consumer holds a copy that is not yet due (uncommitted) and hands it out when it is. A crash
  between the copy and the commit leaves two copies: the guard absorbs the second.
* **Dead letter** = produce to ``<topic>.dlq`` with the reason headers and wait for delivery.
* The producer is idempotent (``enable.idempotence``): the broker drops a batch librdkafka
  itself retried. A publish the *application* retries (its delivery report timed out) is a new
  record: the duplicate the guard must absorb.
* **Slow handlers.** ``max_poll_interval_ms`` bounds the time between two pulls from
  :meth:`KafkaBroker.consume`. The worker pulls only when a slot is free, so when every slot
  stays busy longer than that, librdkafka leaves the group, the partition moves to another
  member, and it re-reads from the last committed offset while the first copy still runs —
  Kafka's "slow consumer" redelivery. The member rejoins at its next pull; commits it attempts
  meanwhile fail harmlessly (not committed = re-read, absorbed by the guard).
"""

from __future__ import annotations

import heapq
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import confluent_kafka
import confluent_kafka.admin
from confluent_kafka.admin import AdminClient

from idemq._clock import Clock, system_clock_ms
from idemq.brokers.base import (
    Delivery,
    Received,
    Traits,
    check_declare_mode,
    header_text,
    outgoing_headers,
)
from idemq.errors import BrokerRefusedError, BrokerUnavailableError, ConfigurationError

__all__ = ["KafkaBroker"]

log = logging.getLogger("idemq.brokers")
client_log = logging.getLogger("idemq.brokers.librdkafka")

NewTopic: Any = confluent_kafka.admin.NewTopic  # type: ignore[attr-defined]  # not in stubs


class _Offsets:
    """Settled offsets per partition; the commit point is the first gap (thread-safe).

    Per partition: the offsets received and not yet settled, and the highest offset settled so
    far. The commit point is the lowest unsettled offset, or, with none, one past the highest
    settled: handlers finish out of order (``--concurrency``, batches), and the offset settled
    last is not always the highest. The point only ever grows, and is kept after a commit, so
    the last commit before leaving the group can name every partition's point again: one whose
    earlier commit was lost or is still in flight is made good there.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], set[int]] = {}  # received, not settled
        self._high: dict[tuple[str, int], int] = {}  # highest settled offset + 1
        self._point: dict[tuple[str, int], int] = {}  # commit point: first unsettled offset
        self._taken: dict[tuple[str, int], int] = {}  # the point last handed to a commit

    def received(self, topic: str, partition: int, offset: int) -> None:
        with self._lock:
            self._pending.setdefault((topic, partition), set()).add(offset)

    def settled(self, topic: str, partition: int, offset: int) -> None:
        with self._lock:
            key = (topic, partition)
            pending = self._pending.setdefault(key, set())
            pending.discard(offset)
            self._high[key] = max(self._high.get(key, 0), offset + 1)
            candidate = min(pending) if pending else self._high[key]
            self._point[key] = max(self._point.get(key, 0), candidate)

    def take(self) -> list[confluent_kafka.TopicPartition]:
        """The points that moved since the last take (what a commit while consuming sends)."""
        with self._lock:
            ready = {k: o for k, o in self._point.items() if o > self._taken.get(k, -1)}
            self._taken.update(ready)
        return [confluent_kafka.TopicPartition(t, p, o) for (t, p), o in ready.items()]

    def every_point(
        self, assigned: list[confluent_kafka.TopicPartition]
    ) -> list[confluent_kafka.TopicPartition]:
        """The point of every partition in ``assigned`` (the last commit before leaving)."""
        with self._lock:
            points = {
                (tp.topic, tp.partition): self._point[(tp.topic, tp.partition)]
                for tp in assigned
                if (tp.topic, tp.partition) in self._point
            }
            self._taken.update(points)
        return [confluent_kafka.TopicPartition(t, p, o) for (t, p), o in points.items()]


def _log_failed_commit(error: Any, offsets: list[confluent_kafka.TopicPartition]) -> None:
    """librdkafka's report of an offset commit (``on_commit``; called from ``poll``): a failed
    one is logged, as :meth:`KafkaBroker._commit` logs one it waited for."""
    if error is not None:
        log.warning("Kafka: commit of %s failed: %s", offsets, error)


class KafkaBroker:
    """A consumer in group ``group`` (default ``idemq.<topic>``) and an idempotent producer.

    One group per topic by default: members of a group rebalance together, so unrelated
    workers sharing a group would stall each other on every join and every crash.
    """

    TRAITS: ClassVar[Traits] = Traits(
        topology_options=True,
        connect_timeout=True,
        # librdkafka wants max.poll.interval.ms >= session.timeout.ms: both are set.
        redelivery_timers=(("session_timeout_ms", 1000), ("max_poll_interval_ms", 1000)),
    )

    def __init__(
        self,
        bootstrap: str,
        *,
        group: str | None = None,
        timeout_s: float = 10.0,
        session_timeout_ms: int = 10_000,
        max_poll_interval_ms: int | None = None,
        client_id: str | None = None,
        clock_ms: Clock = system_clock_ms,
        declare: str = "auto",
        dead_letter: str | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        # librdkafka refuses a poll interval below the session timeout; its default is 5 min.
        poll_ms = max_poll_interval_ms or max(300_000, session_timeout_ms)
        if poll_ms < session_timeout_ms:
            raise ConfigurationError(
                f"max_poll_interval_ms ({poll_ms}) must be >= session_timeout_ms"
                f" ({session_timeout_ms})"
            )
        self.bootstrap = bootstrap
        self.group = group
        self.declare_mode = check_declare_mode(declare)
        self.dead_letter = dead_letter
        self.timeout_s = timeout_s
        # How long the first answer (topic metadata) is waited for: a worker's outage budget
        # (--give-up-after) bounds it, so one attempt cannot outlast the time to give up.
        self.connect_timeout_s = (
            timeout_s if connect_timeout_s is None else min(connect_timeout_s, timeout_s)
        )
        self.session_timeout_ms = session_timeout_ms
        self.max_poll_interval_ms = poll_ms
        self._clock_ms = clock_ms
        # librdkafka's own records (a failed connect every 100 ms) go to logging, not to stderr.
        self._client: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": client_log}
        if client_id:
            self._client["client.id"] = client_id  # sent in every request: logs, quotas
        self._producer = self._new_producer()
        # One produce-and-flush at a time: a flush serves every thread's delivery reports, and
        # each caller must see its own report before deciding whether the produce happened.
        self._produce_lock = threading.Lock()
        self._consumer: confluent_kafka.Consumer | None = None
        self._offsets = _Offsets()

    @classmethod
    def from_url(cls, url: str) -> KafkaBroker:
        """``kafka://host:port[,host:port]?group=NAME&session_timeout_ms=10000``.

        Optional: ``max_poll_interval_ms`` (default 300000, never below the session timeout),
        ``timeout_ms`` (how long a publish waits for its delivery report, default 10000),
        ``client_id``, ``declare=auto|never`` and ``dead_letter=TOPIC`` (see :meth:`declare`),
        ``connect_timeout_ms`` (how long the first metadata answer is waited for, at most and by
        default ``timeout_ms``).
        """
        parts = urlsplit(url)
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        if not parts.netloc:
            raise ConfigurationError(f"Kafka URL needs host:port: {url!r}")
        poll_ms = _int_param(query, "max_poll_interval_ms", url)
        connect_ms = _int_param(query, "connect_timeout_ms", url)
        return cls(
            parts.netloc,
            group=query.get("group"),
            timeout_s=(_int_param(query, "timeout_ms", url) or 10_000) / 1000,
            session_timeout_ms=_int_param(query, "session_timeout_ms", url) or 10_000,
            max_poll_interval_ms=poll_ms,
            client_id=query.get("client_id"),
            declare=query.get("declare", "auto"),
            dead_letter=query.get("dead_letter"),
            connect_timeout_s=None if connect_ms is None else connect_ms / 1000,
        )

    def dead_letter_queue(self, queue: str) -> str:
        """The topic ``dead_letter`` if given, else ``<topic>.dlq``."""
        return self.dead_letter or f"{queue}.dlq"

    def declare(self, queue: str) -> None:
        """Adopt the topic and its dead-letter topic as they are, creating (one partition each)
        only what is missing; with ``declare=never`` a missing one is a
        :class:`~idemq.ConfigurationError` naming it. An existing topic is never changed."""
        admin = AdminClient(dict(self._client))
        names = [queue, self.dead_letter_queue(queue)]
        try:
            existing = admin.list_topics(timeout=self.connect_timeout_s).topics
        except confluent_kafka.KafkaException as exc:
            raise BrokerUnavailableError(f"Kafka: cannot read the topics: {exc}") from exc
        missing = [name for name in names if name not in existing]
        if missing and self.declare_mode == "never":
            raise ConfigurationError(
                f"Kafka topic {', '.join(map(repr, missing))} does not exist"
                " (declare=never: idemq creates nothing)"
            )
        if not missing:
            return
        futures = admin.create_topics([NewTopic(name, 1, 1) for name in missing])
        for future in futures.values():
            try:
                future.result(self.timeout_s)
            except confluent_kafka.KafkaException as exc:
                if exc.args[0].code() != confluent_kafka.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise BrokerUnavailableError(f"Kafka: cannot create topic: {exc}") from exc

    def delete_queue(self, queue: str) -> None:
        """Delete the topic and its dead-letter topic."""
        admin = AdminClient(dict(self._client))
        for future in admin.delete_topics([queue, self.dead_letter_queue(queue)]).values():
            try:
                future.result(self.timeout_s)
            except confluent_kafka.KafkaException as exc:
                raise BrokerUnavailableError(f"Kafka: cannot delete topic: {exc}") from exc

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Produce one record (key = message id) and wait until the broker acknowledged it.

        A record over the size limits (the producer's ``message.max.bytes``, the topic's or the
        broker's), an invalid record or topic, or a topic this client may not write raises
        :class:`~idemq.errors.BrokerRefusedError`: producing it again would meet the same answer.
        """
        all_headers = outgoing_headers(headers, message_id)
        self._produce(queue, body, all_headers, key=message_id, refusals=_REFUSALS)

    def consume(self, queue: str, *, prefetch: int = 1) -> Iterator[Delivery | None]:
        """Poll ``queue`` (adopted or created first: :meth:`declare`); copies scheduled for later
        are held until due."""
        self.declare(queue)
        # A consumer left by an earlier stream (the worker reconnects after a broker error)
        # would stay in the group, be assigned partitions and never poll them: close it.
        self._close_consumer()
        consumer = confluent_kafka.Consumer(
            {
                **self._client,
                "group.id": self.group or f"idemq.{queue}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": self.session_timeout_ms,
                "heartbeat.interval.ms": max(self.session_timeout_ms // 4, 100),
                "max.poll.interval.ms": self.max_poll_interval_ms,
                "on_commit": _log_failed_commit,
            }
        )
        self._consumer = consumer
        try:
            # librdkafka retries an unreachable cluster silently, forever: ask for metadata
            # first, so a worker that cannot reach Kafka says so instead of logging "ready".
            consumer.list_topics(timeout=self.connect_timeout_s)
        except confluent_kafka.KafkaException as exc:
            self._close_consumer()
            raise BrokerUnavailableError(
                f"Kafka: no broker at {self.bootstrap} answered within"
                f" {self.connect_timeout_s}s: {exc}"
            ) from exc
        consumer.subscribe([queue])
        held: list[tuple[int, int, KafkaDelivery]] = []  # (due_ms, tiebreak, delivery)
        while True:
            self._commit(consumer, wait=False)
            if held and held[0][0] <= self._clock_ms():
                yield heapq.heappop(held)[2]
                continue
            try:
                record = consumer.poll(0.2)
            except confluent_kafka.KafkaException as exc:
                raise BrokerUnavailableError(f"Kafka: poll failed: {exc}") from exc
            if record is None:
                yield None
                continue
            error = record.error()
            if error is not None:
                if error.code() in _TRANSIENT_POLL_ERRORS:
                    continue  # a max-poll eviction rejoins at this very poll: keep polling
                raise BrokerUnavailableError(f"Kafka: {error}")
            delivery = self._delivery(queue, record)
            self._offsets.received(queue, delivery.partition, delivery.offset)
            if delivery.not_before_ms > self._clock_ms():
                heapq.heappush(held, (delivery.not_before_ms, delivery.offset, delivery))
                continue
            yield delivery

    def close(self) -> None:
        """Commit what was settled, leave the group, flush the producer."""
        self._close_consumer()
        self._producer.flush(self.timeout_s)

    # -- internals ---------------------------------------------------------------------------

    def _close_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                self._commit(consumer, wait=True)
            finally:
                consumer.close()

    def _new_producer(self) -> confluent_kafka.Producer:
        return confluent_kafka.Producer(
            {
                **self._client,
                "enable.idempotence": True,
                "acks": "all",
                "message.timeout.ms": int(self.timeout_s * 1000),
            }
        )

    def _renew_if_fatal(self, error: Any) -> None:
        """Replace a producer that can never produce again (caller holds the produce lock).

        An idempotent producer whose record timed out in flight must bump its epoch; a broker
        that refuses (Tansu answers PRODUCER_FENCED) leaves it fenced for good, and every later
        publish would fail. A fresh producer gets a new producer id and works again.
        """
        if not isinstance(error, confluent_kafka.KafkaError):
            return
        if error.fatal() or error.code() == confluent_kafka.KafkaError.PRODUCER_FENCED:
            log.warning("Kafka: producer failed for good (%s); starting a new one", error)
            self._producer.purge()
            self._producer = self._new_producer()

    def _commit(self, consumer: confluent_kafka.Consumer, *, wait: bool) -> None:
        """Commit what was settled since the last commit. While consuming, without waiting for
        the broker's answer (``wait=False``): offsets only ever grow and each commit covers the
        earlier ones, so one that fails is made good by the next, and one lost to a crash costs
        only redeliveries that the guard absorbs. Before leaving the group, waiting."""
        if wait:
            # Leaving the group: every partition it holds, whether or not its point moved since
            # the last commit (that one may have failed, or still be in flight).
            try:
                assigned = consumer.assignment()
            except confluent_kafka.KafkaException:
                assigned = []
            offsets = self._offsets.every_point(assigned) or self._offsets.take()
        else:
            offsets = self._offsets.take()
        if not offsets:
            return
        try:
            if wait:
                consumer.commit(offsets=offsets, asynchronous=False)
            else:
                consumer.commit(offsets=offsets, asynchronous=True)
        except confluent_kafka.KafkaException as exc:
            # Not fatal, and no reason to drop the consumer: a member evicted for a slow
            # handler (or caught in a rebalance) cannot commit until it rejoins. Uncommitted
            # offsets are re-read by whoever owns the partition and the guard absorbs them.
            log.warning("Kafka: commit of %s failed: %s", offsets, exc)

    def _delivery(self, queue: str, record: Any) -> KafkaDelivery:
        headers: dict[str, str] = {}
        undecodable: list[str] = []
        for key, value in record.headers() or []:
            headers[key], is_text = header_text(value or b"")
            if not is_text:
                undecodable.append(key)
        received = Received.build(queue, record.value() or b"", headers, undecodable=undecodable)
        return KafkaDelivery(self, received, partition=record.partition(), offset=record.offset())

    def _produce(
        self,
        topic: str,
        body: bytes,
        headers: Mapping[str, str],
        key: str | None = None,
        refusals: frozenset[int] = frozenset(),
    ) -> None:
        """Produce and wait for the delivery report; an error whose code is in ``refusals``
        raises :class:`BrokerRefusedError`, any other :class:`BrokerUnavailableError`."""
        errors: list[Any] = []
        with self._produce_lock:
            try:
                self._producer.produce(
                    topic,
                    body,
                    key=key,
                    headers=list(headers.items()),
                    on_delivery=lambda err, _msg: errors.append(err),
                )
                self._producer.flush(self.timeout_s)
            except (confluent_kafka.KafkaException, BufferError) as exc:
                error = exc.args[0] if exc.args else None
                self._renew_if_fatal(error)
                raise _produce_error(error, refusals, f"Kafka: produce failed: {exc}") from exc
            if errors and errors[0] is not None:
                self._renew_if_fatal(errors[0])
        if not errors:
            raise BrokerUnavailableError(f"Kafka: no delivery report within {self.timeout_s}s")
        if errors[0] is not None:
            raise _produce_error(errors[0], refusals, f"Kafka: produce failed: {errors[0]}")

    # used by KafkaDelivery ---------------------------------------------------------------------

    def settled(self, queue: str, partition: int, offset: int) -> None:
        """Record that ``offset`` may be committed (done on the consuming thread)."""
        self._offsets.settled(queue, partition, offset)

    def requeue(self, delivery: KafkaDelivery, delay_s: float, counted: bool) -> None:
        """Publish a copy due in ``delay_s``, the attempt counter bumped when ``counted``."""
        headers = delivery.retry_headers(
            counted=counted, not_before_ms=self._clock_ms() + int(delay_s * 1000)
        )
        key = delivery.message.id if delivery.message else uuid.uuid4().hex
        self._produce(delivery.queue, delivery.body, headers, key=key)


# What a broker (or the producer, checking first) answers a record it will never take.
_REFUSALS = frozenset(
    {
        confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE,
        confluent_kafka.KafkaError.RECORD_LIST_TOO_LARGE,
        confluent_kafka.KafkaError.INVALID_RECORD,
        confluent_kafka.KafkaError.TOPIC_EXCEPTION,
        confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED,
    }
)


def _produce_error(error: Any, refusals: frozenset[int], text: str) -> Exception:
    if isinstance(error, confluent_kafka.KafkaError) and error.code() in refusals:
        return BrokerRefusedError(text)
    return BrokerUnavailableError(text)


_TRANSIENT_POLL_ERRORS = frozenset(
    {confluent_kafka.KafkaError._PARTITION_EOF, confluent_kafka.KafkaError._MAX_POLL_EXCEEDED}
)


def _int_param(query: Mapping[str, str], name: str, url: str) -> int | None:
    if name not in query:
        return None
    try:
        return int(query[name])
    except ValueError as exc:
        raise ConfigurationError(f"bad {name} in {url!r}") from exc


class KafkaDelivery(Delivery):
    """A record at (partition, offset); settling it lets the offset be committed."""

    def __init__(
        self,
        broker: KafkaBroker,
        received: Received,
        *,
        partition: int,
        offset: int,
    ) -> None:
        super().__init__(received)
        self._broker = broker
        self.partition = partition
        self.offset = offset

    def _ack(self) -> None:
        self._broker.settled(self.queue, self.partition, self.offset)

    def _retry(self, delay_s: float, counted: bool) -> None:
        self._broker.requeue(self, delay_s, counted)
        self._broker.settled(self.queue, self.partition, self.offset)

    def _copy_to_dead_letter(self, headers: dict[str, str]) -> None:
        key = self.message.id if self.message else None
        self._broker._produce(self._broker.dead_letter_queue(self.queue), self.body, headers, key)
