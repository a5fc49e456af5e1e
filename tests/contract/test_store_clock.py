"""Leases on the store's clock (``lease_clock="store"``, the default on Redis, PostgreSQL and
MariaDB/MySQL): workers whose clocks disagree by a minute still agree on whether a lease is live.

Each test counts the handler's effects in the store server itself (a row per effect in a SQL
table, an INCR in Redis), so "exactly once" is the business effect, not the guard's say-so.
The ``client`` runs of the skew test are the control: on the guard's clock the same race runs
the handler twice, so the harness does catch what the store's clock prevents.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import idemq
from idemq.stores.base import ClaimRequest, ForgetResult, Key
from tests.conftest import REDIS_URL, unique
from tests.contract.conftest import dispose, make_store

SERVER_STORES = ["postgres", "mariadb", "mysql-generic", "redis"]
SKEW_MS = 60_000


def deliver(guard: Any, message_id: str, handler: Callable[[Any], Any]) -> Any:
    """``guard.process`` as a broker drives it: a deadlock the server rolled back
    (StoreConflictError: MySQL's generic plan meets them under racing duplicates) is
    redelivered."""
    for _ in range(20):
        try:
            return guard.process(message_id, handler)
        except idemq.StoreConflictError:
            continue
    raise AssertionError(f"{message_id} kept deadlocking")


def skewed(offset_ms: int) -> Callable[[], int]:
    """The wall clock of a worker whose clock is ``offset_ms`` off."""
    return lambda: time.time_ns() // 1_000_000 + offset_ms


class Effects:
    """Counts each message's handler runs in the store's own server."""

    def __init__(self, store: Any, name: str | None = None) -> None:
        """A new effects table (or hash) beside ``store``; with ``name``, an existing one."""
        self.name = name or unique("fx")
        if isinstance(store, idemq.RedisStore):
            self.redis: redis.Redis | None = redis.Redis.from_url(REDIS_URL)
            self.engine: sa.Engine | None = None
        else:
            self.redis = None
            self.engine = store.engine
            if name is None:
                with self.engine.begin() as conn:
                    conn.execute(sa.text(f"CREATE TABLE {self.name} (message_id VARCHAR(64))"))

    def record(self, message_id: str) -> None:
        if self.redis is not None:
            self.redis.hincrby(self.name, message_id, 1)
            return
        assert self.engine is not None
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {self.name} VALUES (:m)"), {"m": message_id})

    def counts(self) -> Counter[str]:
        if self.redis is not None:
            stored = self.redis.hgetall(self.name)
            return Counter({k.decode(): int(v) for k, v in stored.items()})
        assert self.engine is not None
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT message_id FROM {self.name}")).all()
        return Counter(row[0] for row in rows)

    def drop(self) -> None:
        if self.redis is not None:
            self.redis.delete(self.name)
            self.redis.close()
        elif self.engine is not None:
            with self.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE {self.name}"))


@pytest.fixture(params=SERVER_STORES)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def made(kind: str, tmp_path: Path) -> Iterator[tuple[Any, Effects]]:
    store = make_store(kind, tmp_path, lease_clock="store")
    effects = Effects(store)
    yield store, effects
    effects.drop()
    dispose(store)


def test_the_servers_keep_their_own_clock_by_default(made):
    store, _ = made
    assert store.lease_clock == "store"


def test_sqlite_has_no_server_clock(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert idemq.SqlStore(url).lease_clock == "client"
    with pytest.raises(idemq.ConfigurationError, match="lease_clock"):
        idemq.SqlStore(url, lease_clock="store")
    with pytest.raises(idemq.ConfigurationError, match="lease_clock"):
        idemq.RedisStore(REDIS_URL, lease_clock="server")


def race_under_skew(store: Any, effects: Effects, ids: list[str]) -> None:
    """Worker A (true clock) holds each id's lease while its handler runs; worker B, a minute
    fast, is handed the same id meanwhile, then both race through the ids again."""
    guards = {
        name: idemq.Idempotency(
            store, consumer="skew", mode="lease", lease_s=30, clock=skewed(offset)
        )
        for name, offset in (("A", 0), ("B", SKEW_MS))
    }
    inside = threading.Event()
    leave = threading.Event()

    def slow(message_id: str) -> Callable[[Any], str]:
        def handler(tx: Any) -> str:
            effects.record(message_id)
            inside.set()
            leave.wait(10)
            return message_id

        return handler

    for message_id in ids[:3]:
        inside.clear()
        leave.clear()
        errors: list[BaseException] = []

        def run_a(mid: str = message_id, errors: list[BaseException] = errors) -> None:
            try:
                guards["A"].process(mid, slow(mid))
            except idemq.LeaseLostError as error:  # the client-clock control: taken over
                errors.append(error)

        holder = threading.Thread(target=run_a)
        holder.start()
        assert inside.wait(10)
        inside.clear()
        outcome = guards["B"].process(message_id, lambda tx, mid=message_id: effects.record(mid))
        leave.set()
        holder.join(10)
        if store.lease_clock == "store":
            assert outcome.status is idemq.Status.IN_PROGRESS
            assert not errors

    lost: list[BaseException] = []

    def through_all(name: str) -> None:
        for message_id in ids:
            try:
                deliver(guards[name], message_id, lambda tx, mid=message_id: effects.record(mid))
            except idemq.LeaseLostError as error:  # the client-clock control only
                lost.append(error)

    threads = [threading.Thread(target=through_all, args=(n,)) for n in ("A", "B", "A", "B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if store.lease_clock == "store":
        assert not lost


def test_a_minute_of_clock_skew_takes_over_no_live_lease(made):
    store, effects = made
    ids = [f"S{i:02d}" for i in range(30)]
    race_under_skew(store, effects, ids)
    assert effects.counts() == Counter(dict.fromkeys(ids, 1))


def test_control_on_the_guards_clock_the_same_skew_runs_twice(kind, tmp_path):
    store = make_store(kind, tmp_path, lease_clock="client")
    effects = Effects(store)
    try:
        ids = [f"S{i:02d}" for i in range(30)]
        race_under_skew(store, effects, ids)
        counts = effects.counts()
        assert set(counts) == set(ids)
        assert [counts[m] for m in ids[:3]] == [2, 2, 2]  # B took over A's live lease
    finally:
        effects.drop()
        dispose(store)


SKEWED_WORKER = textwrap.dedent(
    """
    import sys
    import idemq
    from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL
    from tests.contract.test_store_clock import Effects, deliver, skewed
    kind, where, fx, offset_ms = sys.argv[1:5]
    if kind == "redis":
        store = idemq.RedisStore(REDIS_URL, prefix=where)
    else:
        url = PG_URL if kind == "postgres" else MYSQL_URL
        flavor = "mysql" if kind == "mysql-generic" else None
        store = idemq.SqlStore(url, table=where, mysql_flavor=flavor)
    effects = Effects(store, fx)
    guard = idemq.Idempotency(
        store, consumer="skew", mode="lease", lease_s=30, clock=skewed(int(offset_ms)),
        renew=False,
    )
    print("READY", flush=True)
    sys.stdin.readline()
    for i in range(100):
        deliver(guard, f"P{i:03d}", lambda tx, m=f"P{i:03d}": effects.record(m))
    print("DONE", flush=True)
    """
)


@pytest.mark.slow
def test_processes_whose_clocks_differ_by_a_minute_run_each_effect_once(made, kind):
    """Four worker processes, clocks 0, +60 s, -60 s and +60 s, through the same 100 ids."""
    store, effects = made
    where = store.prefix if kind == "redis" else store.table.name
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", SKEWED_WORKER, kind, where, effects.name, offset],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=root,
        )
        for offset in ("0", str(SKEW_MS), str(-SKEW_MS), str(SKEW_MS))
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "READY"
        for worker in workers:  # released together, so they race on every id
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "DONE"
            assert worker.wait(60) == 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            for pipe in (worker.stdin, worker.stdout):
                if pipe is not None:
                    pipe.close()
    assert effects.counts() == Counter({f"P{i:03d}": 1 for i in range(100)})


@pytest.mark.slow
def test_an_expired_lease_is_taken_over_even_by_a_slow_clock(made):
    """A crashed worker's 1 s lease, on the store's clock, is over after 1 s of real time, even
    for a worker whose own clock is a minute behind (on its clock the lease has 61 s to go)."""
    store, effects = made
    crashed = ClaimRequest(Key("skew", "X"), None, None, "c" * 32, 0, 1_000)
    assert store.claim(crashed).acquired  # now_ms=0: only the lease's length counts
    late = idemq.Idempotency(
        store, consumer="skew", mode="lease", lease_s=30, clock=skewed(-SKEW_MS)
    )
    assert late.process("X", lambda tx: effects.record("X")).status is idemq.Status.IN_PROGRESS
    time.sleep(1.6)
    outcome = late.process("X", lambda tx: effects.record("X") or "ran")
    assert outcome.status is idemq.Status.PROCESSED
    assert outcome.result == "ran"
    record = store.get("X", "skew")
    assert record is not None
    assert record.attempts == 2
    assert effects.counts() == Counter({"X": 1})


@pytest.mark.slow
def test_renewal_on_the_stores_clock_keeps_a_long_handler_alone(made):
    """A 4 s handler on a 3 s lease, renewed on the store's clock (every second), is not taken
    over by a worker a minute fast that keeps asking."""
    store, effects = made
    slow = idemq.Idempotency(store, consumer="skew", mode="lease", lease_s=3.0)
    fast = idemq.Idempotency(
        store, consumer="skew", mode="lease", lease_s=3.0, clock=skewed(SKEW_MS)
    )
    started = threading.Event()

    def long_handler(tx: Any) -> str:
        effects.record("L")
        started.set()
        time.sleep(4.0)
        return "long"

    outcomes: list[Any] = []
    holder = threading.Thread(target=lambda: outcomes.append(deliver(slow, "L", long_handler)))
    holder.start()
    assert started.wait(10)
    seen = []
    while holder.is_alive():
        seen.append(deliver(fast, "L", lambda tx: effects.record("L")).status)
        time.sleep(0.2)
    holder.join()
    assert outcomes[0].result == "long"
    assert set(seen) <= {idemq.Status.IN_PROGRESS, idemq.Status.DUPLICATE}
    assert effects.counts() == Counter({"L": 1})


def test_stats_and_forget_judge_on_the_stores_clock(made):
    store, _ = made
    live = ClaimRequest(Key("skew", "F"), None, None, "d" * 32, 0, 60_000)
    assert store.claim(live).acquired
    # A caller's clock ten minutes fast does not make the live lease stuck or forgettable.
    ahead = skewed(600_000)()
    assert store.stats(now_ms=ahead).stuck == 0
    assert store.forget("F", "skew", now_ms=ahead) is ForgetResult.LIVE_LEASE
    assert abs(store.stats().now_ms - skewed(0)()) < 5_000  # the server's now, reported
