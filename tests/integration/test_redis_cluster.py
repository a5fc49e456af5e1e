"""RedisStore on a Redis Cluster: what only a cluster can get wrong.

The store, lock, node-lease and broker contracts run on the session's cluster too (their
``redis-cluster`` / ``cluster`` parameters). Here: records spread over every master and the
operator's tools still see and purge all of them; a batch over many slots keeps its order;
cluster URLs; redis-py's cluster errors become idemq's, real ones and constructed ones.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
import redis.exceptions as rx

import idemq
from idemq._clock import system_clock_ms
from idemq.drivers.redis import key_slot, redis_client, translate_error
from idemq.errors import ConfigurationError, StoreError, StoreUnavailableError
from idemq.stores.base import ClaimRequest, Key
from tests.conftest import unique
from tests.redis_cluster import RedisCluster, require_cluster_tools

pytestmark = pytest.mark.redis

CONSUMER = "orders"


def request(message_id: str, owner: str, now_ms: int) -> ClaimRequest:
    return ClaimRequest(Key(CONSUMER, message_id), None, None, owner, now_ms, 30_000)


@pytest.fixture
def store(redis_cluster: RedisCluster) -> idemq.RedisStore:
    made = idemq.RedisStore(redis_cluster.url, prefix=unique("idemqcl"), ttl_s=600)
    yield made
    for key in list(made.client.scan_iter(match=f"{made.prefix}*")):
        made.client.delete(key)
    made.close()


def keys_per_master(cluster: RedisCluster, prefix: str) -> dict[int, int]:
    counts = {}
    for master in cluster.masters():
        client = master.client()
        counts[master.port] = sum(1 for _ in client.scan_iter(match=f"{prefix}*", count=1000))
        client.close()
    return counts


def test_stats_find_and_purge_reach_the_records_of_every_master(
    store: idemq.RedisStore, redis_cluster: RedisCluster
) -> None:
    guard = idemq.Idempotency(store, consumer=CONSUMER, mode="lease", lease_s=30)
    ids = [f"ORDER_{i:03d}" for i in range(300)]
    for message_id in ids:
        guard.process(message_id, lambda tx: 1)
    live = request("LIVE", "busy-worker", system_clock_ms())
    assert store.claim(live).acquired
    spread = keys_per_master(redis_cluster, store.prefix)
    assert len(spread) == 3
    assert all(spread.values()), spread  # records on every master

    stats = store.stats()
    assert (stats.processed, stats.processing) == (300, 1)
    assert [r.message_id for r in store.in_progress()] == ["LIVE"]
    assert [r.message_id for r in store.find("ORDER_123")] == ["ORDER_123"]

    # Every PROCESSED record, wherever it is, goes; the live claim stays.
    later = system_clock_ms() + 3_600_000
    assert store.purge(timedelta(minutes=1), batch_size=7, now_ms=later) == 300
    assert sum(keys_per_master(redis_cluster, store.prefix).values()) == 1
    assert store.get("LIVE", CONSUMER) is not None


def test_a_batch_over_many_slots_comes_back_in_order(store: idemq.RedisStore) -> None:
    now_ms = system_clock_ms()
    done = [f"B{i:02d}" for i in range(0, 40, 3)]
    for message_id in done:
        assert store.claim(request(message_id, "earlier", now_ms)).acquired
    ids = [f"B{i:02d}" for i in range(40)]
    assert len({key_slot(store._layout.key(Key(CONSUMER, m))) for m in ids}) > 30
    claims = store.claim_many([request(m, "batch", now_ms) for m in ids])
    assert [c.acquired for c in claims] == [m not in done for m in ids]
    assert [c.record.owner for c in claims if c.record is not None] == ["earlier"] * len(done)


def test_an_async_store_reaches_every_master_too(redis_cluster: RedisCluster) -> None:
    import asyncio  # noqa: PLC0415

    async def scenario() -> tuple[int, int]:
        store = idemq.AsyncRedisStore(redis_cluster.url, prefix=unique("idemqcl"), ttl_s=600)
        try:
            now_ms = system_clock_ms()
            ids = [f"A{i:02d}" for i in range(60)]
            claims = await store.claim_many([request(m, "w", now_ms) for m in ids])
            assert all(c.acquired for c in claims)
            stats = await store.stats()
            later = now_ms + 3_600_000
            purged = await store.purge(timedelta(minutes=1), now_ms=later)
            for message_id in ids:
                await store.force_release(message_id, CONSUMER)
            return stats.processing, purged
        finally:
            await store.close()

    assert asyncio.run(scenario()) == (60, 0)  # PROCESSING records are never purged


def flush_scripts(cluster: RedisCluster) -> None:
    for master in cluster.masters():
        client = master.client()
        client.script_flush()
        client.close()


def test_a_flushed_script_cache_on_every_master_costs_no_message(
    store: idemq.RedisStore, redis_cluster: RedisCluster
) -> None:
    # EVALSHA goes to the master of its key's slot; when that master lost its scripts (a
    # restart, a failover to a replica that never ran them), the same call goes as EVAL there.
    import asyncio  # noqa: PLC0415

    ids = [f"F{i:02d}" for i in range(30)]  # spread over every master
    guard = idemq.Idempotency(store, consumer=CONSUMER, mode="lease", lease_s=30)
    flush_scripts(redis_cluster)
    assert [guard.process(m, lambda tx: 1).status for m in ids] == [idemq.Status.PROCESSED] * 30
    flush_scripts(redis_cluster)
    assert [guard.process(m, lambda tx: 2).status for m in ids] == [idemq.Status.DUPLICATE] * 30

    async def scenario() -> list[idemq.Status]:
        astore = idemq.AsyncRedisStore(redis_cluster.url, prefix=store.prefix, ttl_s=600)
        aguard = idemq.AsyncIdempotency(astore, consumer=CONSUMER, mode="lease", lease_s=30)
        try:
            flush_scripts(redis_cluster)
            return [(await aguard.process(m, lambda tx: 3)).status for m in ids]
        finally:
            await astore.close()

    assert asyncio.run(scenario()) == [idemq.Status.DUPLICATE] * 30
    assert {r.result for m in ids if (r := store.get(m, CONSUMER))} == {"1"}


def test_a_plain_client_on_a_cluster_node_is_told_so(redis_cluster: RedisCluster) -> None:
    node = redis_cluster.masters()[0]
    plain = redis.Redis(host="127.0.0.1", port=node.port)
    store = idemq.RedisStore(plain, prefix=unique("idemqcl"))
    # An id whose record lives on another master: the node answers MOVED.
    elsewhere = next(
        f"M{i}"
        for i in range(100)
        if redis_cluster.node_of(store._layout.key(Key(CONSUMER, f"M{i}"))).port != node.port
    )
    with pytest.raises(StoreUnavailableError, match=r"cluster=true"):
        store.claim(request(elsewhere, "w", system_clock_ms()))
    plain.close()


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_bad_cluster_flag_is_a_configuration_error(value: str) -> None:
    with pytest.raises(ConfigurationError, match="cluster must be true or false"):
        idemq.RedisStore(f"redis://127.0.0.1:6379/0?cluster={value}")


def test_a_cluster_over_a_unix_socket_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="TCP"):
        idemq.RedisStore("unix:///tmp/redis.sock?cluster=true")


def test_cluster_false_over_a_unix_socket_keeps_the_socket_path() -> None:
    client = redis_client("unix:///tmp/redis.sock?cluster=false&db=2", redis.Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["path"], kwargs["db"]) == ("/tmp/redis.sock", 2)
    client.close()


def test_cluster_false_is_a_plain_client() -> None:
    client = redis_client("redis://127.0.0.1:6379/0?cluster=false", redis.Redis)
    assert type(client) is redis.Redis
    client.close()


def test_an_unreachable_cluster_is_store_unavailable_without_its_password() -> None:
    require_cluster_tools()  # the port below is simply closed; no cluster is needed
    with pytest.raises(StoreUnavailableError) as caught:
        idemq.RedisStore("redis://:s3cret@127.0.0.1:1/0?cluster=true", socket_timeout_s=0.5)
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    "exc",
    [
        rx.ClusterDownError("The cluster is down"),
        rx.MasterDownError("Link with MASTER is down"),
        rx.TryAgainError("Multiple keys request during rehashing of slot"),
        rx.MovedError("3999 127.0.0.1:6381"),
        rx.AskError("3999 127.0.0.1:6381"),
        rx.ClusterError("TTL exhausted."),
        rx.SlotNotCoveredError("Command # 1 (GET k) slot 3999 is not covered"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_cluster_errors_are_store_unavailable(exc: Exception) -> None:
    assert isinstance(translate_error(exc, "claim", "cluster x"), StoreUnavailableError)  # type: ignore[arg-type]


def test_a_cluster_client_that_cannot_connect_is_store_unavailable() -> None:
    try:
        raise rx.RedisClusterException("Redis Cluster cannot be connected.") from (
            rx.ConnectionError("Connection refused")
        )
    except rx.RedisClusterException as exc:
        translated = translate_error(exc, "claim", "cluster x")
    assert isinstance(translated, StoreUnavailableError)
    other = translate_error(rx.RedisClusterException("all keys must map to one slot"), "x", "y")
    assert type(other) is StoreError
