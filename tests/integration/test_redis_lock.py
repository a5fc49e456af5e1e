"""RedisLock / AsyncRedisLock on the real Redis: ownership, expiry, fencing, renewal.

The central scenario is the one the seed's ``SETNX … DEL`` lock gets wrong: a holder paused past
its TTL must neither release the new owner's lock nor land its late write.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, create_engine, select

from idemq.business.versioned import versioned_update
from idemq.drivers.redis import is_cluster, redis_client
from idemq.errors import ConfigurationError, LockError, LockNotOwnedError, StoreUnavailableError
from idemq.lock.redis_lock import AsyncRedisLock, RedisLock
from tests.conftest import REDIS_URL, unique

pytestmark = pytest.mark.redis


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
    p = unique("idemqlock")
    yield p
    for key in client.scan_iter(match=f"{p}*"):
        client.delete(key)


def make(client: redis.Redis, prefix: str, name: str = "job", **kw: object) -> RedisLock:
    return RedisLock(client, name, prefix=prefix, **kw)  # type: ignore[arg-type]


def test_acquire_owned_release(client: redis.Redis, prefix: str) -> None:
    a, b = make(client, prefix), make(client, prefix)
    assert a.acquire()
    assert a.owned()
    assert not b.acquire(blocking=False)
    assert not b.owned()
    started = time.monotonic()
    assert not b.acquire(timeout_s=0.2)
    assert 0.19 <= time.monotonic() - started < 1.0
    a.release()
    assert not a.owned()
    assert b.acquire(blocking=False)
    with pytest.raises(LockNotOwnedError):
        a.release()  # released already: never touches b's lock
    assert b.owned()
    b.release()


def test_fencing_tokens_strictly_increase_even_after_counter_loss(
    client: redis.Redis, prefix: str
) -> None:
    lock = make(client, prefix)
    tokens = []
    for _ in range(5):
        assert lock.acquire()
        tokens.append(lock.fencing_token)
        lock.release()
    client.delete(lock._state.keys.fence)  # e.g. a restart without persistence
    assert lock.acquire()
    tokens.append(lock.fencing_token)
    lock.release()
    assert tokens == sorted(set(tokens))
    with pytest.raises(LockError):
        _ = make(client, prefix, "never").fencing_token


def test_paused_holder_cannot_release_extend_or_write(
    client: redis.Redis, prefix: str, tmp_path: Path
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'biz.db'}")
    meta = MetaData()
    accounts = Table(
        "accounts",
        meta,
        Column("id", String(16), primary_key=True),
        Column("owner", String(8)),
        Column("version", Integer, nullable=False),
        Column("fence_token", BigInteger),  # tokens are ~2**51: BIGINT
    )
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(accounts.insert().values(id="acc1", owner="none", version=1))

    a = make(client, prefix, "acc1", ttl_s=0.2)
    b = make(client, prefix, "acc1", ttl_s=5)
    assert a.acquire()
    with engine.connect() as conn:
        version_read_by_a = conn.execute(select(accounts.c.version)).scalar_one()
    time.sleep(0.3)  # A "pauses" past its TTL
    assert b.acquire(blocking=False)
    assert b.fencing_token > a.fencing_token
    with engine.begin() as conn:
        version = conn.execute(select(accounts.c.version)).scalar_one()
        assert versioned_update(
            conn, "accounts", "id", "acc1", version, {"owner": "B"}, fence=b.fencing_token
        )
    with engine.begin() as conn:
        # A wakes and writes with its stale fencing token (even at the current version): refused.
        current = conn.execute(select(accounts.c.version)).scalar_one()
        assert not versioned_update(
            conn, "accounts", "id", "acc1", current, {"owner": "A"}, fence=a.fencing_token
        )
        assert not versioned_update(
            conn, "accounts", "id", "acc1", version_read_by_a, {"owner": "A"}
        )
    with pytest.raises(LockNotOwnedError):
        a.extend()
    with pytest.raises(LockNotOwnedError):
        a.release()
    assert b.owned()
    with engine.connect() as conn:
        assert conn.execute(select(accounts.c.owner)).scalar_one() == "B"
    b.release()
    engine.dispose()


def test_context_manager(client: redis.Redis, prefix: str) -> None:
    with make(client, prefix) as held:
        assert held.owned()
        with pytest.raises(LockError), make(client, prefix, blocking_timeout_s=0.05):
            pytest.fail("entered a held lock")
    assert make(client, prefix).acquire(blocking=False)


def test_context_manager_reports_a_lost_lock(client: redis.Redis, prefix: str) -> None:
    with pytest.raises(LockNotOwnedError), make(client, prefix, ttl_s=0.05):
        time.sleep(0.1)


def test_mutual_exclusion_under_contention(client: redis.Redis, prefix: str) -> None:
    counter = f"{prefix}:counter"
    client.set(counter, 0)

    def work(seed: int) -> None:
        lock = make(client, prefix, "counter", rng=random.Random(seed), poll_s=0.001)
        for _ in range(25):
            with lock:
                value = int(client.get(counter) or 0)  # read-modify-write: racy without the lock
                client.set(counter, value + 1)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(client.get(counter) or 0) == 200


def test_auto_renew_keeps_the_lock_and_reports_loss(client: redis.Redis, prefix: str) -> None:
    # TTL 1.5 s, renewed every 0.5 s: a renewal thread held up by up to a second on a loaded
    # machine still keeps it; the loss is waited for, not slept for.
    lost: list[str] = []
    lock = make(client, prefix, ttl_s=1.5, auto_renew=True, on_lost=lambda: lost.append("x"))
    assert lock.acquire()
    time.sleep(3.2)  # > 2 TTLs: only renewal can have kept it
    assert lock.owned()
    assert not lock.lost
    client.set(lock._state.keys.lock, "thief", px=30_000)  # another owner (after a long pause)
    _wait_until(lambda: lock.lost, 10, "the renewal to notice the loss")
    assert lost == ["x"]
    with pytest.raises(LockNotOwnedError):
        lock.release()
    assert client.get(lock._state.keys.lock) == b"thief"


def test_auto_renew_is_bounded(client: redis.Redis, prefix: str) -> None:
    lock = make(client, prefix, ttl_s=1.0, auto_renew=True, max_renewals=2)
    assert lock.acquire()
    # Two renewals (about 0.33 s and 0.67 s in), then the lock expires by itself (about 1.7 s
    # in); an unbounded renewal would keep it for the whole wait.
    _wait_until(lambda: not lock.owned(), 10, "the lock to expire once its renewals ran out")
    assert not lock.lost  # not stolen: just no longer renewed
    with pytest.raises(LockNotOwnedError):
        lock.release()


def _wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


def test_names_cannot_escape_their_keys(client: redis.Redis, prefix: str) -> None:
    names = ["a", "a*", "*", "a}b", "{a}", "a:fence", "line\nbreak"]
    locks = [make(client, prefix, name) for name in names]
    assert all(lock.acquire(blocking=False) for lock in locks)
    for lock in locks:
        assert lock._state.keys.lock.count("{") == 1
        assert lock._state.keys.lock.count("}") == 1
        lock.release()


def test_configuration_and_unreachable_server(prefix: str) -> None:
    with pytest.raises(ConfigurationError):
        RedisLock(redis.Redis(), "x", ttl_s=0)
    with pytest.raises(ConfigurationError):
        RedisLock(redis.Redis(), "", ttl_s=1)
    with pytest.raises(ConfigurationError):
        RedisLock(redis.Redis(), "x", prefix="a{b}")
    dead = redis.Redis(port=1, password="hunter2", socket_connect_timeout=0.2, retry=None)
    with pytest.raises(StoreUnavailableError) as info:
        RedisLock(dead, "x", prefix=prefix).acquire(blocking=False)
    assert "hunter2" not in str(info.value)


def test_lock_is_not_reentrant(client: redis.Redis, prefix: str) -> None:
    lock = make(client, prefix)
    assert lock.acquire()
    with pytest.raises(LockError):
        lock.acquire(blocking=False)
    lock.release()


# --- async twin ---------------------------------------------------------------------------


@pytest.fixture
async def aclient(client: Any, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """An asyncio client of the server ``client`` talks to (a Cluster one for the cluster)."""
    url = request.getfixturevalue("redis_cluster").url if is_cluster(client) else REDIS_URL
    c = redis_client(url, redis.asyncio.Redis)
    yield c
    await c.aclose()


async def test_async_lock(aclient: redis.asyncio.Redis, prefix: str) -> None:
    a = AsyncRedisLock(aclient, "job", ttl_s=1.0, prefix=prefix)  # outlives the next two steps
    b = AsyncRedisLock(aclient, "job", ttl_s=5, prefix=prefix)
    assert await a.acquire()
    assert await a.owned()
    assert not await b.acquire(timeout_s=0.05)
    deadline = time.monotonic() + 10
    while await a.owned():  # A "pauses" past its TTL
        assert time.monotonic() < deadline, "A's lock never expired"
        await asyncio.sleep(0.05)
    assert await b.acquire(blocking=False)
    assert b.fencing_token > a.fencing_token
    with pytest.raises(LockNotOwnedError):
        await a.release()
    assert await b.owned()
    await b.release()
    async with AsyncRedisLock(aclient, "job", prefix=prefix) as held:
        assert await held.owned()


async def test_async_auto_renew(aclient: redis.asyncio.Redis, prefix: str) -> None:

    lost: list[int] = []
    lock = AsyncRedisLock(
        aclient, "renew", ttl_s=1.5, prefix=prefix, auto_renew=True, on_lost=lambda: lost.append(1)
    )
    assert await lock.acquire()
    await asyncio.sleep(3.2)  # > 2 TTLs (renewed every 0.5 s, a second of slack)
    assert await lock.owned()
    await aclient.set(lock._state.keys.lock, "thief", px=30_000)
    deadline = time.monotonic() + 10
    while not lock.lost:
        assert time.monotonic() < deadline, "the renewal never noticed the loss"
        await asyncio.sleep(0.05)
    assert lost == [1]
    with pytest.raises(LockNotOwnedError):
        await lock.release()


def test_locked_says_whether_anyone_holds_it(client: redis.Redis, prefix: str) -> None:
    mine = RedisLock(client, "job", ttl_s=30, prefix=prefix)
    theirs = RedisLock(client, "job", ttl_s=30, prefix=prefix)
    assert not theirs.locked()
    assert mine.acquire()
    assert theirs.locked()
    assert not theirs.owned()
    mine.release()
    assert not theirs.locked()


def test_acquire_waits_only_as_long_as_the_lock_was_told_to(
    client: redis.Redis, prefix: str
) -> None:
    holder = RedisLock(client, "job", ttl_s=30, prefix=prefix)
    assert holder.acquire()
    waiter = RedisLock(client, "job", ttl_s=30, prefix=prefix, blocking_timeout_s=0.3)
    began = time.monotonic()
    assert not waiter.acquire()  # not a 30 s wait for the holder's TTL
    assert 0.2 <= time.monotonic() - began < 5
    holder.release()


@pytest.mark.parametrize("ttl_s", [None, 0, -1, True, "30"])
def test_a_lock_without_a_ttl_is_refused(client: redis.Redis, prefix: str, ttl_s: object) -> None:
    with pytest.raises(ConfigurationError):
        RedisLock(client, "job", ttl_s=ttl_s, prefix=prefix)  # type: ignore[arg-type]


async def test_async_locked_and_a_bounded_acquire(redis_url: str, prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        holder = AsyncRedisLock(client, "job", ttl_s=30, prefix=prefix)
        waiter = AsyncRedisLock(client, "job", ttl_s=30, prefix=prefix, blocking_timeout_s=0.3)
        assert await holder.acquire()
        assert await waiter.locked()
        assert not await waiter.acquire()
        await holder.release()
        assert not await waiter.locked()
    finally:
        await client.aclose()
