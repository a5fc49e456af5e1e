"""Per-broker fault settings: short redelivery timers for workers, a partitionable producer.

What each broker offers the three causes (``capabilities``):

========== ===================================== ===================================== =========
broker     cause 1: producer retry               cause 2: slow consumer → redelivery   cause 3
========== ===================================== ===================================== =========
embedded   confirm dropped after the commit [1]  visibility timeout                    yes
redis      proxy; XADD reply lost                XAUTOCLAIM after ``claim_idle_ms``    yes
amqp       proxy; publisher confirm lost         channel closed after a short          yes
                                                 ``consumer_timeout`` (opt-in) [2]
nats       proxy; PubAck lost — the server drops AckWait (``ack_wait_s``)              yes
           the retry by ``Nats-Msg-Id`` [3]
kafka      proxy as the advertised listener;     ``max.poll.interval.ms`` exceeded:    yes
           delivery report lost [4]              partition moves to another member;
                                                 opt-in [5]
========== ===================================== ===================================== =========

[1] a SQLite file has no network: the lost confirm is injected in the publish call itself.
[2] RabbitMQ 3.10 has only a server-wide ``consumer_timeout`` (per-queue needs 3.12+), 30 min
    by default. With ``tune_broker`` the run sets it to 2 s (channel tick 250 ms) through
    ``rabbitmqctl eval`` and restores it afterwards (:mod:`idemq.chaos.rabbitmq_timeout`);
    without it, slow handlers are not injected and the run says why.
[3] cause 1 reaches the broker but JetStream's duplicate window drops the retried copy — the
    run reports it as injected, not delivered.
[4] Kafka clients connect to the *advertised* listener after bootstrap, so the proxy must be
    that listener: the broker advertises ``127.0.0.1:P`` and the URL says ``?chaos_proxy=P``.
    Every client then goes through the proxy; only the producer's connections (found by its
    ``client.id`` in their first request) are partitioned. Without ``chaos_proxy``, no cause 1.
[5] the worker pulls only when a slot is free, so a handler that outlasts the poll interval
    stops the polling; librdkafka leaves the group and another member re-reads from the last
    committed offset. Needs at least two workers (one partition: one consuming member). On
    when the URL gives ``max_poll_interval_ms``; off by default because Tansu 0.6's group
    coordinator can stall for good after such evictions: its JoinGroup responses keep naming
    a member that has left as the leader, so SyncGroup never completes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from idemq.brokers import open_broker, traits_of
from idemq.brokers.base import Broker, Delivery
from idemq.chaos import rabbitmq_timeout
from idemq.chaos.events import COPY_HEADER
from idemq.chaos.proxy import FaultProxy
from idemq.errors import BrokerUnavailableError, ConfigurationError

__all__ = [
    "Capabilities",
    "ProducerBroker",
    "capabilities",
    "declare_queue",
    "open_producer",
    "redelivery_s",
    "slow_s",
    "worker_url",
]

RABBITMQ_CONSUMER_TIMEOUT_MS = 2000
RABBITMQ_TICK_MS = 250
KAFKA_PROXY_PARAM = "chaos_proxy"
KAFKA_POLL_PARAM = "max_poll_interval_ms"
KAFKA_PRODUCER_ID = "idemq-chaos-producer"  # client.id: how the proxy tells the producer apart


@dataclass(frozen=True)
class Capabilities:
    """Which causes a broker lets the chaos runner produce, and its redelivery timer."""

    partition: bool
    slow: bool
    redelivery_s: float  # after this long unacked, the broker hands the message out again
    partition_note: str = ""
    slow_note: str = ""
    min_uptime_s: float = 0.0  # how long a fresh worker needs before it consumes at all
    handover_s: float = 0.0  # from the timer firing until another worker holds the copy
    arm_timeout_s: float = 3.0  # an armed worker that acks nothing this long is SIGKILLed anyway
    tuned: bool = False  # the run changes a server-wide setting (RabbitMQ consumer_timeout)


_CAPABILITIES = {
    "embedded": Capabilities(True, True, 1.0),
    "redis": Capabilities(True, True, 1.0),
    "amqp": Capabilities(
        True,
        False,
        (RABBITMQ_CONSUMER_TIMEOUT_MS + RABBITMQ_TICK_MS) / 1000,
        slow_note=(
            "RabbitMQ's consumer_timeout is server-wide before 3.12; opt in with --tune-broker"
            " to shorten it for the run (rabbitmqctl, restored afterwards)"
        ),
        handover_s=0.5,  # channel close, requeue, push to another consumer
    ),
    "nats": Capabilities(True, True, 1.0),
    "kafka": Capabilities(
        False,
        False,
        3.0,
        partition_note=(
            "Kafka clients reconnect to the advertised listener, not the proxy: advertise"
            f" 127.0.0.1:P and add ?{KAFKA_PROXY_PARAM}=P to the broker URL"
        ),
        slow_note=(
            f"opt in with ?{KAFKA_POLL_PARAM}=MS in the broker URL (slow handlers outlast it;"
            " off by default: Tansu 0.6 can leave a group stuck after such evictions)"
        ),
        min_uptime_s=4.0,  # group join + first fetch after a restart
        handover_s=2.5,  # leave the group, rebalance, fetch from the committed offset
        arm_timeout_s=8.0,  # a rebalance after a kill can leave a member without records as long
    ),
}


def scheme_of(url: str) -> str:
    """The broker family of ``url`` (``amqps`` → ``amqp``, ``rediss`` → ``redis``)."""
    scheme = urlsplit(url).scheme.lower()
    return {"amqps": "amqp", "rediss": "redis"}.get(scheme, scheme)


def capabilities(url: str, *, tune_broker: bool = False) -> Capabilities:
    """What the broker behind ``url`` supports (see the module table).

    ``tune_broker``: allow a server-wide setting to change for the run (RabbitMQ cause 2).
    """
    scheme = scheme_of(url)
    if scheme not in _CAPABILITIES:
        raise ConfigurationError(f"idemq chaos does not support broker scheme {scheme!r}")
    caps = _CAPABILITIES[scheme]
    if scheme == "kafka" and _kafka_proxy_port(url) is not None:
        caps = replace(caps, partition=True, partition_note="")
    if scheme == "kafka" and KAFKA_POLL_PARAM in _query(url):
        caps = replace(caps, slow=True, slow_note="")
    if scheme == "amqp" and tune_broker:
        if rabbitmq_timeout.rabbitmqctl() is None:
            return replace(caps, slow_note="--tune-broker needs rabbitmqctl on this machine")
        caps = replace(caps, slow=True, slow_note="", tuned=True)
    return caps


def _query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(url.partition("?")[2]).items()}


def _with_query(url: str, extra: Mapping[str, str], drop: tuple[str, ...] = ()) -> str:
    base = url.partition("?")[0]
    query = {k: v for k, v in _query(url).items() if k not in drop}
    for key, value in extra.items():
        query.setdefault(key, value)  # the user's own setting wins
    # Not urlunsplit: it turns embedded:////abs/path into embedded://abs/path (a relative path).
    return f"{base}?{urlencode(query)}"


def _kafka_proxy_port(url: str) -> int | None:
    given = _query(url).get(KAFKA_PROXY_PARAM)
    if given is None:
        return None
    if not given.isdigit():
        raise ConfigurationError(f"{KAFKA_PROXY_PARAM} must be a port number, got {given!r}")
    return int(given)


def worker_url(url: str) -> str:
    """``url`` with the broker's redelivery timers set short, so causes 2 and 3 show quickly."""
    scheme = scheme_of(url)
    seconds = capabilities(url).redelivery_s
    timers: dict[str, str] = {}
    for param, factor in traits_of(url).redelivery_timers:
        value = seconds * factor
        timers[param] = str(int(value) if factor > 1 else value)
    if scheme == "kafka":
        # librdkafka refuses a poll interval below the session timeout, whoever set which.
        query = _query(url)
        poll_ms = int(query.get(KAFKA_POLL_PARAM, timers[KAFKA_POLL_PARAM]))
        session_ms = int(query.get("session_timeout_ms", min(int(seconds * 1000), poll_ms)))
        poll_ms = max(poll_ms, session_ms)
        timers = {"session_timeout_ms": str(session_ms), KAFKA_POLL_PARAM: str(poll_ms)}
    if not timers and KAFKA_PROXY_PARAM not in _query(url):
        return url
    return _with_query(url, timers, drop=(KAFKA_PROXY_PARAM,))


def redelivery_s(url: str) -> float:
    """The longest redelivery timer in force in ``url`` (or the default, if none is given)."""
    given = [
        float(value) / factor
        for param, factor in traits_of(url).redelivery_timers
        if (value := _query(url).get(param))
    ]
    return max(given) if given else capabilities(url).redelivery_s


def slow_s(url: str, caps: Capabilities) -> float:
    """How long a slow handler stalls: past the timer, and past the handover to another worker."""
    return 1.5 * redelivery_s(worker_url(url)) + caps.handover_s


class ProducerBroker:
    """The producer's broker: stamps :data:`COPY_HEADER` on every publish attempt, and can drop
    the next confirm (for the embedded queue, which has no wire to cut)."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner
        self.attempts: Counter[str] = Counter()
        self._lose_next_confirm = threading.Event()

    def lose_next_confirm(self) -> None:
        """The next publish commits, then reports an unconfirmed publish (cause 1, in-process)."""
        self._lose_next_confirm.set()

    def declare(self, queue: str) -> None:
        """See :meth:`Broker.declare`."""
        self.inner.declare(queue)

    def consume(self, queue: str, *, prefetch: int) -> Iterator[Delivery | None]:
        """See :meth:`Broker.consume`."""
        return self.inner.consume(queue, prefetch=prefetch)

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> None:
        """Publish one attempt, numbered per message id in :data:`COPY_HEADER`."""
        key = message_id or ""
        self.attempts[key] += 1
        stamped = {**(headers or {}), COPY_HEADER: str(self.attempts[key])}
        self.inner.publish(queue, body, headers=stamped, message_id=message_id)
        if self._lose_next_confirm.is_set():
            self._lose_next_confirm.clear()
            raise BrokerUnavailableError("confirm lost (injected partition)")

    def dead_letter_queue(self, queue: str) -> str:
        """See :meth:`Broker.dead_letter_queue`."""
        return self.inner.dead_letter_queue(queue)

    def delete_queue(self, queue: str) -> None:
        """See :meth:`Broker.delete_queue`."""
        self.inner.delete_queue(queue)

    def close(self) -> None:
        """See :meth:`Broker.close`."""
        self.inner.close()


def open_producer(
    url: str, *, confirm_timeout_s: float, partitions: bool
) -> tuple[ProducerBroker, FaultProxy | None]:
    """The producer's broker, through a :class:`FaultProxy` when the broker allows (cause 1).

    Kafka with ``chaos_proxy`` gets its proxy whatever ``partitions`` says: the broker
    advertises the proxy's address, so the workers cannot reach it without one.
    """
    scheme = scheme_of(url)
    if scheme == "kafka":
        return _open_kafka_producer(url, confirm_timeout_s)
    proxy: FaultProxy | None = None
    target = url
    if partitions and capabilities(url).partition and scheme != "embedded":
        parts = urlsplit(url)
        proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or _DEFAULT_PORT[scheme])
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{proxy.address}" if userinfo else proxy.address
        target = urlunsplit(parts._replace(netloc=netloc))
    try:
        inner = _connect(scheme, target, confirm_timeout_s)
    except BaseException:
        if proxy is not None:
            proxy.close()
        raise
    return ProducerBroker(inner), proxy


def declare_queue(producer: ProducerBroker, url: str, queue: str, *, consumers: int) -> None:
    """Declare the run's queue; on Kafka, a topic with one partition per consumer.

    A Kafka group gives each partition to one member: with the adapter's one-partition topic,
    one worker of W would ever get a message, and the kills and slow handlers of the others
    would never touch one. The topic is created here (confluent-kafka's ``AdminClient``) before
    the adapter's ``declare``, which then finds it and creates only the dead-letter topic.
    """
    if scheme_of(url) == "kafka" and consumers > 1:
        import confluent_kafka  # noqa: PLC0415  # the kafka extra, needed only here
        import confluent_kafka.admin  # noqa: PLC0415

        new_topic: Any = confluent_kafka.admin.NewTopic  # type: ignore[attr-defined]
        admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": urlsplit(url).netloc})
        futures = admin.create_topics([new_topic(queue, consumers, 1)])
        for future in futures.values():
            try:
                future.result(10.0)
            except confluent_kafka.KafkaException as exc:
                if exc.args[0].code() != confluent_kafka.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise BrokerUnavailableError(f"Kafka: cannot create topic: {exc}") from exc
    producer.declare(queue)


def _open_kafka_producer(
    url: str, confirm_timeout_s: float
) -> tuple[ProducerBroker, FaultProxy | None]:
    proxy_port = _kafka_proxy_port(url)
    proxy: FaultProxy | None = None
    if proxy_port is not None:
        parts = urlsplit(url)
        upstream = (parts.hostname or "127.0.0.1", parts.port or 9092)
        proxy = FaultProxy(*upstream, listen_port=proxy_port, victim=KAFKA_PRODUCER_ID.encode())
    # The delivery-report wait is the confirm timeout: shorter than a partition window, so
    # the Publisher retries (a new record) instead of waiting the partition out.
    settings = {"client_id": KAFKA_PRODUCER_ID, "timeout_ms": str(int(confirm_timeout_s * 1000))}
    try:
        # The workers' timers too: a poll interval the user gave needs a session below it.
        inner = open_broker(_with_query(worker_url(url), settings))
    except BaseException:
        if proxy is not None:
            proxy.close()
        raise
    return ProducerBroker(inner), proxy


_DEFAULT_PORT = {"redis": 6379, "amqp": 5672, "nats": 4222}


def _connect(scheme: str, url: str, confirm_timeout_s: float) -> Broker:
    # Each client's confirm timeout must be shorter than a partition window, or the publish
    # would simply wait the partition out and no retry (no duplicate) would happen.
    if scheme == "amqp":
        from idemq.brokers.rabbitmq import RabbitMQBroker  # noqa: PLC0415

        return RabbitMQBroker(
            _with_query(url, {"reconnect_interval": "0.3"}), confirm_timeout_s=confirm_timeout_s
        )
    if scheme == "nats":
        from idemq.brokers.nats import NatsBroker  # noqa: PLC0415

        return NatsBroker(urlunsplit(urlsplit(url)._replace(query="")), timeout_s=confirm_timeout_s)
    if scheme == "redis":
        timeout = str(confirm_timeout_s)
        return open_broker(_with_query(url, {"socket_timeout": timeout}))
    return open_broker(url)
