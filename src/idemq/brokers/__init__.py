"""Broker adapters: one module per broker, all the same shape (see :mod:`idemq.brokers.base`).

The URL scheme picks the broker; each adapter's client library is imported only when used, so
``pip install idemq[rabbitmq]`` is enough for RabbitMQ.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from idemq.brokers.base import Broker, Delivery
from idemq.brokers.settlement import RetryPolicy
from idemq.drivers.urls import mask_url
from idemq.errors import ConfigurationError

__all__ = ["SCHEMES", "Broker", "Delivery", "RetryPolicy", "open_broker"]

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


def open_broker(url: str) -> Broker:
    """Connect to the broker named by ``url``'s scheme (``amqp``, ``kafka``, ``nats``, ``redis``,
    ``mqtt``, ``embedded``)."""
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
        raise ConfigurationError(
            f"the {scheme} broker needs its client library: install idemq[{extra}]"
        ) from exc
    broker: Broker = getattr(module, class_name).from_url(url)
    return broker
