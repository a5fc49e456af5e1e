"""Per-broker fault settings: short redelivery timers for workers, a partitionable producer.

What each broker offers the three causes (``capabilities``):

========== ===================================== ===================================== =========
broker     cause 1: producer retry               cause 2: slow consumer → redelivery   cause 3
========== ===================================== ===================================== =========
embedded   confirm dropped after the commit [1]  visibility timeout                    yes
redis      proxy; XADD reply lost                XAUTOCLAIM after ``claim_idle_ms``    yes
amqp       proxy; publisher confirm lost         no [2]                                yes
nats       proxy; PubAck lost — the server drops no (absorbed: ack_wait ok) [3]        yes
           the retry by ``Nats-Msg-Id`` [3]
kafka      no [4]                                no [5]                                yes
========== ===================================== ===================================== =========

[1] a SQLite file has no network: the lost confirm is injected in the publish call itself.
[2] RabbitMQ closes a channel after ``consumer_timeout``, a server-wide setting (30 min by
    default, checked about once a minute; per-queue ``x-consumer-timeout`` needs 3.12+).
[3] NATS cause 2 works (``ack_wait_s``); cause 1 reaches the broker but JetStream's duplicate
    window drops the retried copy — the run reports it as injected, not delivered.
[4] Kafka clients connect to the *advertised* listener after bootstrap, bypassing the proxy.
[5] the adapter does not expose ``max.poll.interval.ms``; librdkafka heartbeats from a
    background thread, so a slow handler never misses the session timeout.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from idemq.brokers import open_broker
from idemq.brokers.base import Broker, Delivery
from idemq.chaos.events import COPY_HEADER
from idemq.chaos.proxy import FaultProxy
from idemq.errors import BrokerUnavailableError, ConfigurationError

__all__ = ["Capabilities", "ProducerBroker", "capabilities", "open_producer", "worker_url"]


@dataclass(frozen=True)
class Capabilities:
    """Which causes a broker lets the chaos runner produce, and its redelivery timer."""

    partition: bool
    slow: bool
    redelivery_s: float  # after this long unacked, the broker hands the message out again
    partition_note: str = ""
    slow_note: str = ""
    min_uptime_s: float = 0.0  # how long a fresh worker needs before it consumes at all


_CAPABILITIES = {
    "embedded": Capabilities(True, True, 1.0),
    "redis": Capabilities(True, True, 1.0),
    "amqp": Capabilities(
        True, False, 1.0, slow_note="RabbitMQ consumer_timeout is a server-wide setting"
    ),
    "nats": Capabilities(True, True, 1.0),
    "kafka": Capabilities(
        False,
        False,
        3.0,
        partition_note="Kafka clients reconnect to the advertised listener, not the proxy",
        slow_note="the Kafka adapter does not expose max.poll.interval.ms",
        min_uptime_s=4.0,  # group join + first fetch after a restart
    ),
}

# Query parameter that sets each adapter's redelivery timer, and its unit factor from seconds.
_TIMER_PARAM = {
    "embedded": ("visibility_timeout_s", 1),
    "redis": ("claim_idle_ms", 1000),
    "nats": ("ack_wait_s", 1),
    "kafka": ("session_timeout_ms", 1000),
}


def scheme_of(url: str) -> str:
    """The broker family of ``url`` (``amqps`` → ``amqp``, ``rediss`` → ``redis``)."""
    scheme = urlsplit(url).scheme.lower()
    return {"amqps": "amqp", "rediss": "redis"}.get(scheme, scheme)


def capabilities(url: str) -> Capabilities:
    """What the broker behind ``url`` supports (see the module table)."""
    scheme = scheme_of(url)
    if scheme not in _CAPABILITIES:
        raise ConfigurationError(f"idemq chaos does not support broker scheme {scheme!r}")
    return _CAPABILITIES[scheme]


def _with_query(url: str, extra: Mapping[str, str]) -> str:
    base, _, query_text = url.partition("?")
    query = {k: v[0] for k, v in parse_qs(query_text).items()}
    for key, value in extra.items():
        query.setdefault(key, value)  # the user's own setting wins
    # Not urlunsplit: it turns embedded:////abs/path into embedded://abs/path (a relative path).
    return f"{base}?{urlencode(query)}"


def worker_url(url: str) -> str:
    """``url`` with the broker's redelivery timer set short, so causes 2 and 3 show quickly."""
    scheme = scheme_of(url)
    caps = capabilities(url)
    if scheme not in _TIMER_PARAM:
        return url
    param, factor = _TIMER_PARAM[scheme]
    value = caps.redelivery_s * factor
    return _with_query(url, {param: str(int(value) if factor > 1 else value)})


def redelivery_s(url: str) -> float:
    """The redelivery timer :func:`worker_url` puts in force (or the user's, if given)."""
    scheme = scheme_of(url)
    if scheme in _TIMER_PARAM:
        param, factor = _TIMER_PARAM[scheme]
        given = parse_qs(urlsplit(url).query).get(param)
        if given:
            return float(given[0]) / factor
    return capabilities(url).redelivery_s


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
    """The producer's broker, through a :class:`FaultProxy` when the broker allows (cause 1)."""
    scheme = scheme_of(url)
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
