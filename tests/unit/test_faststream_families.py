"""Which FastStream family a message belongs to is told by FastStream's message classes."""

from __future__ import annotations

import pytest
from faststream.kafka.message import KafkaMessage
from faststream.message import StreamMessage
from faststream.nats.message import NatsMessage
from faststream.rabbit.message import RabbitMessage
from faststream.redis.message import RedisListMessage, RedisStreamMessage

from idemq.integrations._faststream_brokers import family_of


@pytest.mark.parametrize(
    ("cls", "family"),
    [
        (RabbitMessage, "rabbit"),
        (NatsMessage, "nats"),
        (KafkaMessage, "kafka"),
        (RedisStreamMessage, "redis-stream"),
        (RedisListMessage, "in-place"),  # a list pop cannot be nacked: retried in place
        (StreamMessage, "generic"),
    ],
)
def test_a_message_class_finds_its_family(cls: type, family: str) -> None:
    message = cls.__new__(cls)  # the class is all that counts
    assert family_of(message).name == family


def test_anything_else_is_generic() -> None:
    assert family_of(object()).name == "generic"
