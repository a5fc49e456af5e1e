"""RedisStore / AsyncRedisStore on the real Redis: what only the Redis store can get wrong.

The lease contract (tests/contract/test_lease_contract.py) runs the store protocol's rows on
Redis too (takeover, release by a non-owner, payload mismatch, duplicates ...). Here: key
escaping and hash tags, the record's shape and format, PX retention, malformed and foreign
values, what the scripts must never rewrite, configuration, server errors, and races.

Every test works under its own unique key prefix and deletes it afterwards. The business effect
of the race tests is an HINCRBY per message id in a separate hash, done only by the claim winner.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
import redis
import redis.asyncio

import idemq
from idemq._clock import system_clock_ms
from idemq.drivers.redis import is_cluster, translate_error
from idemq.errors import (
    ConfigurationError,
    InvalidInputError,
    LeaseLostError,
    StoreError,
    StoreUnavailableError,
)
from idemq.stores.base import AsyncStore, ClaimRequest, Key, RecordStatus, Store
from idemq.stores.redis.keys import Layout
from idemq.stores.redis.store import AsyncRedisStore, RedisStore
from tests.conftest import REDIS_URL, port_open, unique

pytestmark = pytest.mark.redis

NOW_MS = 1_700_000_000_000
C = "orders"


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=prefix.replace("*", "\\*") + "*", count=1000):
        client.delete(key)


@pytest.fixture(params=["redis", "cluster"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The shared Redis, then the session's Redis Cluster (a ``RedisCluster`` client)."""
    if request.param == "cluster":
        yield request.getfixturevalue("redis_cluster").client()  # closed with the cluster
        return
    c = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    yield c
    c.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    p = unique("idemqt")
    yield p
    delete_prefix(client, p)


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> RedisStore:
    # The guard's clock: these tests write records at chosen times (the contract suite's
    # test_store_clock.py covers Redis's own clock, the default).
    return RedisStore(client, prefix=prefix, ttl_s=600, lease_clock="client")


def req(message_id: str, owner: str, now_ms: int = NOW_MS, lease_ms: int = 30_000, **kw: Any):
    return ClaimRequest(
        key=Key(kw.pop("consumer", C), message_id),
        business_id=kw.pop("business_id", None),
        payload_hash=kw.pop("payload_hash", None),
        owner=owner,
        now_ms=now_ms,
        lease_ms=lease_ms,
    )


def test_implements_the_store_protocol(store: RedisStore) -> None:
    assert isinstance(store, Store)
    assert isinstance(AsyncRedisStore(REDIS_URL), AsyncStore)


def test_claim_complete_duplicate(store: RedisStore, client: redis.Redis, prefix: str) -> None:
    first = store.claim(req("m1", "A", business_id="order_1", payload_hash="h1"))
    assert first.acquired
    rival = store.claim(req("m1", "B", now_ms=NOW_MS + 1000, payload_hash="h1"))
    assert not rival.acquired
    assert rival.record is not None
    assert rival.record.status is RecordStatus.PROCESSING
    assert (rival.record.owner, rival.record.lease_until_ms) == ("A", NOW_MS + 30_000)
    assert rival.record.business_id == "order_1"

    store.complete(Key(C, "m1"), "A", '{"paid":true}', NOW_MS + 2000)
    dup = store.claim(req("m1", "C", now_ms=NOW_MS + 5000, payload_hash="h1"))
    assert not dup.acquired
    record = dup.record
    assert record is not None
    assert record.status is RecordStatus.PROCESSED
    assert (record.result, record.payload_hash, record.attempts) == ('{"paid":true}', "h1", 1)
    assert record.created_time is not None
    assert record.created_time.tzinfo is not None
    assert record.created_time.timestamp() * 1000 == NOW_MS
    assert record.processed_time is not None
    assert record.processed_time.timestamp() * 1000 == NOW_MS + 2000
    assert store.get("m1", C) == record
    # Exactly one key per record, and done records live ttl_s (GC), not forever.
    keys = list(client.scan_iter(match=f"{prefix}*"))
    assert len(keys) == 1
    assert 590_000 < client.pttl(keys[0]) <= 600_000


def test_processing_record_outlives_its_lease_plus_retention(
    store: RedisStore, client: redis.Redis, prefix: str
) -> None:
    store.claim(req("m1", "A", lease_ms=50_000))
    (key,) = client.scan_iter(match=f"{prefix}*")
    assert 640_000 < client.pttl(key) <= 650_000


def test_release_never_deletes_a_processed_record(store: RedisStore) -> None:
    # The release script deletes only "0" NUL owner NUL ...: a PROCESSED record of the same
    # owner survives, or its message would run again.
    assert store.claim(req("m1", "B")).acquired
    store.complete(Key(C, "m1"), "B", "1", NOW_MS)
    store.release(Key(C, "m1"), "B")
    record = store.get("m1", C)
    assert record is not None
    assert record.status is RecordStatus.PROCESSED


def test_complete_after_gc_or_release_is_lease_lost(store: RedisStore) -> None:
    with pytest.raises(LeaseLostError):
        store.complete(Key(C, "never-claimed"), "A", "1", NOW_MS)


def test_replayed_claim_and_complete_are_harmless(store: RedisStore) -> None:
    # redis-py re-sends a command whose reply was lost: the same owner must still win.
    request = req("m1", "A")
    assert store.claim(request).acquired
    assert store.claim(request).acquired
    store.complete(Key(C, "m1"), "A", '"first"', NOW_MS)
    store.complete(Key(C, "m1"), "A", '"again"', NOW_MS + 5)
    record = store.get("m1", C)
    assert record is not None
    assert record.result == '"first"'


def test_real_short_ttl_lease_expires(store: RedisStore) -> None:
    # A 2 s lease: the early attempt right after the claim sees it live even on a loaded
    # machine; the takeover waits for the lease to be over by a clear margin.
    guard_a = idemq.Idempotency(store, consumer=C, mode="lease", lease_s=2.0)
    request = guard_a.policy.request("m-real")
    assert store.claim(request).acquired  # worker A claims, then stalls
    blocked = guard_a.process("m-real", lambda tx: "B too early")
    assert blocked.status is idemq.Status.IN_PROGRESS
    time.sleep(max(request.lease_until_ms - system_clock_ms(), 0) / 1000 + 0.3)
    out = guard_a.process("m-real", lambda tx: "B")
    assert (out.status, out.result) == (idemq.Status.PROCESSED, "B")
    with pytest.raises(LeaseLostError):
        store.complete(request.key, request.owner, '"A"', system_clock_ms())
    record = store.get("m-real", C)
    assert record is not None
    assert (record.result, record.attempts) == ('"B"', 2)


def test_claim_many_in_order(store: RedisStore) -> None:
    store.claim(req("live", "X"))
    store.claim(req("done", "Y"))
    store.complete(Key(C, "done"), "Y", "7", NOW_MS)
    batch = [req("new1", "A"), req("live", "A"), req("done", "A"), req("new1", "B")]
    claims = store.claim_many(batch)
    assert [c.acquired for c in claims] == [True, False, False, False]
    assert claims[1].record is not None
    assert claims[1].record.owner == "X"
    assert claims[2].record is not None
    assert claims[2].record.result == "7"
    assert claims[3].record is not None
    assert claims[3].record.owner == "A"  # the same id twice in a batch: the first wins
    assert store.claim_many([]) == []


def test_purge_by_the_store_clock_in_bounded_batches(
    store: RedisStore, client: redis.Redis, prefix: str
) -> None:
    for consumer in ("billing", "mail", "stock"):
        store.claim(req("shared", f"own-{consumer}", consumer=consumer))
    store.complete(Key("mail", "shared"), "own-mail", "1", NOW_MS)
    store.complete(Key("billing", "shared"), "own-billing", "1", NOW_MS + 15_000)
    assert len(store.in_progress(limit=1)) == 1

    now = [NOW_MS + 10_000]
    purging = RedisStore(client, prefix=prefix, clock=lambda: now[0], lease_clock="client")
    assert purging.purge(timedelta(seconds=20)) == 0  # processed 10 s ago: kept
    now[0] += 20_000
    assert purging.purge(timedelta(seconds=20), batch_size=1) == 1
    assert store.get("shared", "mail") is None
    assert [r.consumer for r in store.find("shared")] == ["billing", "stock"]
    with pytest.raises(ConfigurationError):
        purging.purge(timedelta(0), batch_size=0)


NASTY_IDS = [
    "*",
    "?",
    "[a-z]",
    "a\\b",
    "with space",
    "line\nbreak",
    "{}",
    "}{",
    "a}b{c",
    "x:y",
    "%2A",
    "emoji \U0001f600 ünïcode",
    "lone \ud800 surrogate",
    "k" * 10_000,
]


@pytest.mark.parametrize("message_id", NASTY_IDS, ids=lambda s: repr(s[:12]))
def test_key_injection_is_inert(store: RedisStore, client: redis.Redis, message_id: str) -> None:
    bystanders = ["a", "b*", "x", "%2A-other"]
    for other in bystanders:
        store.claim(req(other, "bystander"))
    assert store.claim(req(message_id, "A", consumer="c:}{*")).acquired
    assert not store.claim(req(message_id, "B", consumer="c:}{*")).acquired
    store.complete(Key("c:}{*", message_id), "A", '"ok"', NOW_MS)
    record = store.get(message_id, "c:}{*")
    assert record is not None
    assert (record.message_id, record.consumer, record.result) == (message_id, "c:}{*", '"ok"')
    assert [(r.consumer, r.message_id) for r in store.find(message_id)] == [("c:}{*", message_id)]
    # The hash tag survives: one "{", one "}", in that order, in every key.
    for raw in client.scan_iter(match=f"{store._layout.prefix}*"):
        name = raw.decode()
        assert name.count("{") == 1
        assert name.count("}") == 1
        assert name.endswith("}")
    assert store.purge(timedelta(0)) >= 1
    assert {r.message_id for r in store.in_progress()} == set(bystanders)


def test_consumer_and_id_cannot_collide(store: RedisStore) -> None:
    assert store.claim(req("b:c", "A", consumer="a")).acquired
    assert store.claim(req("c", "B", consumer="a:b")).acquired


def test_bad_configuration() -> None:
    with pytest.raises(ConfigurationError):
        RedisStore(REDIS_URL, prefix="bad{tag}")
    with pytest.raises(ConfigurationError):
        RedisStore(REDIS_URL, ttl_s=0)
    with pytest.raises(ConfigurationError) as info:
        RedisStore("http://user:hunter2@127.0.0.1/0")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigurationError):
        RedisStore(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="utf-8"):
        # redis-py encodes the store's text with the client's encoding; records are UTF-8.
        RedisStore(redis.Redis.from_url(REDIS_URL, encoding="latin-1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server_is_store_unavailable_without_password() -> None:
    port = free_port()
    assert not port_open("127.0.0.1", port)
    store = RedisStore(f"redis://user:hunter2@127.0.0.1:{port}/0", socket_timeout_s=0.5)
    assert "hunter2" not in repr(store)
    with pytest.raises(StoreUnavailableError) as info:
        store.claim(req("m1", "A"))
    assert "hunter2" not in str(info.value)
    assert f"127.0.0.1:{port}" in str(info.value)
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    store.close()


def test_a_server_that_cannot_parse_the_claim_is_named_too_old(
    client: redis.Redis, prefix: str
) -> None:
    # Redis < 7.0 answers SET … NX … GET with "syntax error"; provoke the same reply for real.
    with pytest.raises(redis.ResponseError) as raw:
        client.execute_command("SET", f"{prefix}x", "v", "NX", "NOT-AN-OPTION")
    error = translate_error(raw.value, "claim", "127.0.0.1:6379/0")
    assert type(error) is StoreError
    assert "needs Redis >= 7.0" in str(error)
    assert "claim" in str(error)


def test_foreign_key_under_the_prefix_is_a_store_error(
    store: RedisStore, client: redis.Redis, prefix: str
) -> None:
    client.hset(store._layout.key(Key(C, "m1")), "not", "a string")  # WRONGTYPE for GET
    with pytest.raises(StoreError) as info:
        store.claim(req("m1", "A"))
    assert isinstance(info.value.__cause__, redis.ResponseError)


def test_malformed_record_is_a_store_error(
    store: RedisStore, client: redis.Redis, prefix: str
) -> None:
    key = store._layout.key(Key(C, "m1"))
    for foreign in (b"not a record", b"7\x00X\x00\x001\x00\x00\x00\x00\x00"):
        client.set(key, foreign)
        with pytest.raises(StoreError, match="malformed"):
            store.claim(req("m1", "A"))
        with pytest.raises(StoreError, match="malformed"):
            store.get("m1", C)
        assert client.get(key) == foreign  # untouched
    assert store.stats().processing == 0  # counting skips it


def test_complete_never_rewrites_what_is_not_its_processing_record(
    store: RedisStore, client: redis.Redis
) -> None:
    # The complete script rewrites only a PROCESSING record of this owner with the nine values
    # of a claim: anything else (another owner's, a done one, a truncated one) stays as it is.
    key = store._layout.key(Key(C, "m1"))
    others = [
        b"not a record",
        b"0\x00AB\x0099\x001\x005\x00\x00\x00\x00",  # owner "AB"'s PROCESSING record
        b"1\x00AB\x00\x001\x005\x006\x00\x00\x00r",  # PROCESSED by "AB"
    ]
    for other in others:
        client.set(key, other)
        with pytest.raises(LeaseLostError):
            store.complete(Key(C, "m1"), "A", "1", NOW_MS)
        assert client.get(key) == other
    mine_done = b"1\x00A\x00\x001\x005\x006\x00\x00\x00r"
    client.set(key, mine_done)
    store.complete(Key(C, "m1"), "A", "2", NOW_MS)  # a replayed complete: done, not rewritten
    assert client.get(key) == mine_done
    truncated = [b"0\x00A\x00", b"0\x00A\x0099\x001\x00", b"0\x00A\x0099\x001\x005\x007"]
    for shape in truncated:  # owner A's head, but not the nine values of a claim
        client.set(key, shape)
        with pytest.raises(StoreError, match="malformed idemq record"):
            store.complete(Key(C, "m1"), "A", "1", NOW_MS)
        assert client.get(key) == shape


@pytest.mark.parametrize(
    "message_id",
    [
        "".join(map(chr, range(1, 128))),
        "ORDER_1",
        "orders:3:1337",
        ":%3A:",
        "a:b/c d",
        "é€\U0001f680:}",
    ],
)
def test_keys_are_the_percent_encoding_of_consumer_and_id(message_id: str) -> None:
    # Records written by every earlier version must stay reachable: a key is, byte for byte,
    # quote(safe="") of both parts.
    layout = Layout.build("p", 60)
    expected = f"p:{{{quote('c:1', safe='')}:{quote(message_id, safe='')}}}"
    assert layout.key(Key("c:1", message_id)) == expected
    assert layout.parse_key(expected) == Key("c:1", message_id)


def test_conflict_reply_carries_every_field_and_a_result_with_separators(
    store: RedisStore,
) -> None:
    result = '"a\x00b\\0c\x00"'  # NUL is the reply's field separator: the result is last, whole
    first = req("m1", "A", business_id="order_1", payload_hash="ab" * 32)
    assert store.claim(first).acquired
    store.complete(first.key, "A", result, NOW_MS + 5)
    claim = store.claim(req("m1", "B", payload_hash="ab" * 32))
    record = claim.record
    assert not claim.acquired
    assert record is not None
    assert (record.status, record.result, record.owner) == (RecordStatus.PROCESSED, result, "A")
    assert (record.business_id, record.payload_hash, record.attempts) == ("order_1", "ab" * 32, 1)
    assert record.lease_until_ms is None
    assert record.created_time is not None
    assert record.processed_time is not None
    assert record.processed_time - record.created_time == timedelta(milliseconds=5)
    live = store.claim(req("m2", "A", lease_ms=1000))
    assert live.acquired
    held = store.claim(req("m2", "B")).record
    assert held is not None
    assert (held.status, held.owner, held.lease_until_ms) == (
        RecordStatus.PROCESSING,
        "A",
        NOW_MS + 1000,
    )
    assert (held.result, held.business_id, held.payload_hash) == (None, None, None)


def test_a_result_with_a_lone_surrogate_round_trips(store: RedisStore, client: redis.Redis) -> None:
    # Through the guard a lone surrogate is stored as JSON's own escape (every store can keep
    # that); a caller of the store itself may still hand it raw text holding one, which
    # redis-py's strict encoder would refuse: the store encodes it itself (surrogatepass).
    guard = idemq.Idempotency(store, consumer=C, mode="lease", lease_s=5)
    first = guard.process("m1", lambda tx: "lone \udcff surrogate")
    again = guard.process("m1", lambda tx: "not run")
    assert (first.status, again.status) == (idemq.Status.PROCESSED, idemq.Status.DUPLICATE)
    assert again.result == "lone \udcff surrogate"
    stored = client.get(store._layout.key(Key(C, "m1")))
    assert stored is not None
    assert stored.endswith(b'"lone \\udcff surrogate"')
    assert store.claim(req("m2", "A")).acquired
    store.complete(Key(C, "m2"), "A", '"raw \udcff"', 1)
    record = store.get("m2", C)
    assert record is not None
    assert record.result == '"raw \udcff"'


def test_nul_in_owner_or_business_id_is_refused_before_writing(store: RedisStore) -> None:
    with pytest.raises(InvalidInputError):
        store.claim(req("m1", "A\x00B"))
    with pytest.raises(InvalidInputError):
        store.claim(req("m1", "A", business_id="b\x00"))
    assert store.get("m1", C) is None


def _race_worker(store: RedisStore, guard_args: dict[str, Any], ids: list[str], effects: str):
    guard = idemq.Idempotency(store, **guard_args)
    client = store.client
    for message_id in ids:
        guard.process(message_id, lambda tx, m=message_id: client.hincrby(effects, m, 1))


def test_eight_threads_race_each_effect_once(
    store: RedisStore, client: redis.Redis, prefix: str
) -> None:
    ids = [f"ORDER_{i:04d}" for i in range(500)]
    effects = f"{prefix}:effects"
    args = {"consumer": C, "mode": "lease", "lease_s": 30}
    threads = []
    for seed in range(8):
        shuffled = random.Random(seed).sample(ids, len(ids))
        threads.append(threading.Thread(target=_race_worker, args=(store, args, shuffled, effects)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = client.hgetall(effects)
    assert len(counts) == 500
    assert set(counts.values()) == {b"1"}
    assert store.in_progress() == []


def _process_worker(url: str, prefix: str, seed: int, effects: str) -> None:
    ids = random.Random(seed).sample([f"ORDER_{i:04d}" for i in range(500)], 500)
    store = RedisStore(url, prefix=prefix)
    _race_worker(store, {"consumer": C, "mode": "lease", "lease_s": 30}, ids, effects)
    store.close()


def test_eight_processes_race_each_effect_once(
    client: redis.Redis, prefix: str, request: pytest.FixtureRequest
) -> None:
    effects = f"{prefix}:effects"
    url = request.getfixturevalue("redis_cluster").url if is_cluster(client) else REDIS_URL
    ctx = multiprocessing.get_context("spawn")
    args = [(url, prefix, seed, effects) for seed in range(8)]
    procs = [ctx.Process(target=_process_worker, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    counts = client.hgetall(effects)
    assert len(counts) == 500
    assert set(counts.values()) == {b"1"}


# --- async twin ---------------------------------------------------------------------------


@pytest.fixture
async def astore(redis_url: str, prefix: str) -> AsyncIterator[AsyncRedisStore]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield AsyncRedisStore(client, prefix=prefix, ttl_s=600, lease_clock="client")
    await client.aclose()


async def test_async_store_semantics(astore: AsyncRedisStore) -> None:
    assert (await astore.claim(req("m1", "A", lease_ms=1000))).acquired
    assert not (await astore.claim(req("m1", "B"))).acquired
    assert (await astore.claim(req("m1", "B", now_ms=NOW_MS + 1000))).acquired
    with pytest.raises(LeaseLostError):
        await astore.complete(Key(C, "m1"), "A", "1", NOW_MS)
    await astore.complete(Key(C, "m1"), "B", "2", NOW_MS + 1)
    claims = await astore.claim_many([req("m1", "C"), req("m2", "C")])
    assert [c.acquired for c in claims] == [False, True]
    await astore.release(Key(C, "m2"), "C")
    assert await astore.get("m2", C) is None
    assert [r.result for r in await astore.find("m1")] == ["2"]
    assert await astore.in_progress() == []
    assert await astore.purge(timedelta(0)) == 1
    assert await astore.get("m1", C) is None


async def test_async_guard_and_owned_url_client(prefix: str, client: redis.Redis) -> None:
    store = AsyncRedisStore(REDIS_URL, prefix=prefix)
    guard = idemq.AsyncIdempotency(store, consumer=C, mode="lease", lease_s=5)
    effects = f"{prefix}:effects"

    async def handler(tx: object) -> int:
        return int(client.hincrby(effects, "x", 1))

    outs = [await guard.process("m1", handler) for _ in range(3)]
    assert [o.status for o in outs] == [idemq.Status.PROCESSED] + [idemq.Status.DUPLICATE] * 2
    assert client.hget(effects, "x") == b"1"
    await store.close()
