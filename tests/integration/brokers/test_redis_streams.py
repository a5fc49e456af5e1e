"""The broker contract on Redis Streams (consumer groups, XAUTOCLAIM, acks held for one XACK)."""

from __future__ import annotations

import time

import pytest

from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.brokers.redis_streams import RedisStreamsBroker
from tests.contract.brokers import BrokerContract
from tests.contract.brokers_queued_acks import publish_ids, take
from tests.redis_cluster import RedisCluster

pytestmark = pytest.mark.redis


class TestRedisStreams(BrokerContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self, redis_url: str) -> str:
        # Entries idle for 1 s (a dead consumer's) are reclaimed by XAUTOCLAIM.
        return f"{redis_url}?claim_idle_ms=1000"

    def test_acks_are_held_until_the_next_read_or_close(
        self, broker_url: str, queue: str, publisher: Broker
    ) -> None:
        ids = publish_ids(publisher, queue, "H", 3)
        broker = open_broker(broker_url)
        acks = [delivery.ack() for delivery in take(broker, queue, len(ids))]
        assert not any(ack.done() for ack in acks), "held, to go out in one XACK"
        broker.close()
        assert [ack.exception(0) for ack in acks] == [None] * len(ids)
        time.sleep(1.5)  # past claim_idle_ms: an unacked entry would be reclaimed now
        again = open_broker(broker_url)
        try:
            assert take(again, queue, 1, timeout_s=2.0) == []
        finally:
            again.close()

    def test_held_acks_of_a_dead_consumer_are_redelivered(
        self, broker_url: str, queue: str, publisher: Broker
    ) -> None:
        ids = publish_ids(publisher, queue, "D", 2)
        dying = open_broker(broker_url)
        assert isinstance(dying, RedisStreamsBroker)
        for delivery in take(dying, queue, len(ids)):
            delivery.ack()
        dying.client.close()  # the process "dies": its held acks never leave
        again = open_broker(broker_url)
        try:
            back = take(again, queue, len(ids), timeout_s=10.0)
        finally:
            again.close()
        assert sorted(d.message.id for d in back if d.message) == ids
        # Redelivered (Redis counts 2 deliveries), but no handler run failed: still attempt 1.
        assert {d.delivery_attempt for d in back} == {1}


class TestRedisStreamsOnACluster(TestRedisStreams):
    """The same contract on the session's Redis Cluster: a queue and its ``.dlq`` are in two
    slots, so the dead letter is XADD then XACK rather than one MULTI."""

    @pytest.fixture
    def broker_url(self, redis_cluster: RedisCluster) -> str:
        return f"{redis_cluster.url}&claim_idle_ms=1000"
