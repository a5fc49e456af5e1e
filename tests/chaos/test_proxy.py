"""The fault proxy makes a real duplicate: a publish lands, its reply is lost, the retry lands."""

from __future__ import annotations

import time

import pytest
import redis

from idemq.chaos.proxy import FaultProxy, loopback_only
from idemq.errors import ConfigurationError
from tests.conftest import require_service, unique


def test_only_loopback_targets_are_accepted() -> None:
    assert loopback_only("localhost") == "127.0.0.1"
    for host in ("10.0.0.1", "example.org", "::1", "0.0.0.0"):
        with pytest.raises(ConfigurationError):
            loopback_only(host)
    with pytest.raises(ConfigurationError):
        FaultProxy("192.168.1.1", 6379)


def test_half_partition_loses_the_reply_not_the_write() -> None:
    require_service("redis")
    proxy = FaultProxy("127.0.0.1", 6379)
    stream = unique("chaos_proxy")
    direct = redis.Redis(host="127.0.0.1", port=6379)
    # No client-side retry: this test is the retry's author.
    client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=0.3, retry=None)
    try:
        client.xadd(stream, {"n": "0"})  # through the proxy, healthy
        proxy.partition(0.6)
        with pytest.raises(redis.exceptions.TimeoutError):
            client.xadd(stream, {"n": "1"})  # landed, but the reply was dropped
        assert direct.xlen(stream) == 2
        assert proxy.dropped_bytes > 0
        time.sleep(0.7)  # window over: the tainted connection is reset, the client reconnects
        client.xadd(stream, {"n": "1"})  # the producer's retry: a real duplicate in the broker
        assert [f[b"n"] for _, f in direct.xrange(stream)] == [b"0", b"1", b"1"]
    finally:
        direct.delete(stream)
        client.close()
        direct.close()
        proxy.close()


def test_a_partition_spares_connections_without_the_victim_marker() -> None:
    """Kafka's case: every client goes through the proxy, only the producer loses replies."""
    require_service("redis")
    proxy = FaultProxy("127.0.0.1", 6379, victim=b"chaos-victim")
    stream = unique("chaos_proxy_victim")
    direct = redis.Redis(host="127.0.0.1", port=6379)
    # The first command on each connection names the client, as a Kafka request header does.
    victim = redis.Redis(
        host="127.0.0.1",
        port=proxy.port,
        socket_timeout=0.3,
        retry=None,
        client_name="chaos-victim",
    )
    spared = redis.Redis(
        host="127.0.0.1", port=proxy.port, socket_timeout=0.3, retry=None, client_name="bystander"
    )
    try:
        victim.ping()
        spared.ping()
        proxy.partition(0.6)
        with pytest.raises(redis.exceptions.TimeoutError):
            victim.xadd(stream, {"who": "victim"})  # landed, reply dropped
        spared.xadd(stream, {"who": "bystander"})  # same proxy, same window: untouched
        assert direct.xlen(stream) == 2
    finally:
        direct.delete(stream)
        for client in (victim, spared, direct):
            client.close()
        proxy.close()
