"""Broker adapters: one module per broker, all the same shape (see :mod:`idemq.brokers.base`).

The URL scheme picks the broker; each adapter's client library is imported only when used, so
``pip install 'idemq[rabbitmq]'`` is enough for RabbitMQ. What else an adapter takes or offers it
declares itself, in its class's ``TRAITS`` (:class:`~idemq.brokers.base.Traits`).
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from idemq.brokers.base import Broker, Delivery, Traits
from idemq.brokers.settlement import RetryPolicy
from idemq.drivers.extras import missing_extra
from idemq.drivers.urls import mask_url
from idemq.errors import ConfigurationError

__all__ = ["SCHEMES", "Broker", "Delivery", "RetryPolicy", "open_broker", "traits_of"]

# scheme → (module, class, extra to install)
SCHEMES: dict[str, tuple[str, str, str]] = {
    "embedded": ("idemq.brokers.embedded", "EmbeddedBroker", ""),
    "amqp": ("idemq.brokers.rabbitmq", "RabbitMQBroker", "rabbitmq"),
    "amqps": ("idemq.brokers.rabbitmq", "RabbitMQBroker", "rabbitmq"),
    "redis": ("idemq.brokers.redis_streams", "RedisStreamsBroker", "redis"),
    "rediss": ("idemq.brokers.redis_streams", "RedisStreamsBroker", "redis"),
    "nats": ("idemq.brokers.nats", "NatsBroker", "nats"),
    "kafka": ("idemq.brokers.kafka", "KafkaBroker", "kafka"),
    "mqtt": ("idemq.brokers.mqtt", "MqttBroker", "mqtt"),
}


def open_broker(
    url: str,
    *,
    declare: str | None = None,
    dead_letter: str | None = None,
    connect_timeout_s: float | None = None,
) -> Broker:
    """Connect to the broker named by ``url``'s scheme (``amqp``, ``kafka``, ``nats``, ``redis``,
    ``mqtt``, ``embedded``).

    ``declare`` (``auto``: adopt what exists, create what is missing; ``never``: create nothing)
    and ``dead_letter`` (the dead-letter queue, subject, topic or stream) are the URL's
    ``?declare=…`` and ``?dead_letter=…`` (RabbitMQ, NATS, Kafka and Redis Streams; MQTT has
    nothing to declare: its session is the subscription).

    ``connect_timeout_s``: how long one connect attempt may wait (Kafka's first metadata
    answer, NATS's connect; the other clients fail faster on their own), so a worker's
    ``--give-up-after`` is not outlasted by a single attempt.
    """
    adapter = _adapter(url)
    traits: Traits = adapter.TRAITS
    options = {"declare": declare, "dead_letter": dead_letter}
    if any(value is not None for value in options.values()):
        if not traits.topology_options:
            raise ConfigurationError(
                "declare/dead_letter are options of RabbitMQ, NATS, Kafka and Redis Streams,"
                f" not of {urlsplit(url).scheme!r}"
            )
        url = with_query(url, {k: v for k, v in options.items() if v is not None})
    if connect_timeout_s is not None and traits.connect_timeout:
        url = with_query(url, {"connect_timeout_ms": str(max(1, round(connect_timeout_s * 1000)))})
    broker: Broker = adapter.from_url(url)
    return broker


def traits_of(url: str) -> Traits:
    """What the adapter of ``url``'s scheme declares about itself (its redelivery timers …)."""
    traits: Traits = _adapter(url).TRAITS
    return traits


def _adapter(url: str) -> Any:
    """The adapter class of ``url``'s scheme, its module imported now."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(sorted(SCHEMES))
        raise ConfigurationError(
            f"unknown broker URL scheme {scheme!r} in {mask_url(url)!r} (known: {known})"
        )
    module_name, class_name, extra = SCHEMES[scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise missing_extra(f"the {scheme} broker", extra, exc) from exc
    return getattr(module, class_name)


def with_query(url: str, params: dict[str, str]) -> str:
    """``url`` with ``params`` set in its query (replacing parameters of the same name)."""
    parts = urlsplit(url)
    kept = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in params]
    return urlunsplit(parts._replace(query=urlencode([*kept, *params.items()])))
