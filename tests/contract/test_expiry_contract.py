"""``expires_after_s``: a completed record older than the window counts as absent.

Runs on the memory store and every SQL store, in lease mode and (SQL) transactional mode, with
the guard's clock faked so that "a day later" takes no time. What is asserted is the business
effect: the handler's runs (lease mode) or the rows of a ledger written in the dedup transaction
(transactional mode). Redis has the same window as the record's key TTL (``ttl_s``): the last
test shows it on the real server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, require_service, unique, wait_until
from tests.contract.conftest import (
    LEASE_CLOCK,
    SQL_STORES,
    FakeClock,
    dispose,
    make_sql_store,
)

WINDOW_S = 3600
WINDOW_MS = WINDOW_S * 1000
# The fake clock starts at the real time, so records stamped by a server's clock (the
# server-clock test below) and by the fake clock agree on when "now" is.
START_MS = time.time_ns() // 1_000_000

# (store kind, mode): the memory store has lease mode only.
CASES = [("memory", "lease")] + [(k, m) for k in SQL_STORES for m in ("lease", "transactional")]


def expiring_store(kind: str, tmp_path: Path, **options: Any) -> Any:
    if kind == "memory":
        return idemq.MemoryStore(expires_after_s=WINDOW_S)
    store = make_sql_store(kind, tmp_path, expires_after_s=WINDOW_S, **options)
    store.create_schema()
    return store


class Effects:
    """The business effect of a test's handlers: rows of a ledger table written through ``tx``
    in transactional mode, a list in lease mode (the effect is the handler's run)."""

    def __init__(self, store: Any, mode: str) -> None:
        self.store = store
        self.mode = mode
        self.runs: list[str] = []
        self._lock = threading.Lock()
        self.table: sa.Table | None = None
        if mode == "transactional":
            self.table = sa.Table(
                unique("ledger"),
                sa.MetaData(),
                sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                sa.Column("message_id", sa.String(128)),
            )
            self.table.create(store.engine)

    def handler(self, message_id: str, result: object) -> Callable[[Any], object]:
        def handle(tx: Any) -> object:
            if self.table is not None:
                tx.execute(self.table.insert().values(message_id=message_id))
            else:
                with self._lock:
                    self.runs.append(message_id)
            return result

        return handle

    def count(self, message_id: str) -> int:
        if self.table is None:
            return self.runs.count(message_id)
        query = sa.select(sa.func.count()).where(self.table.c.message_id == message_id)
        with self.store.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def drop(self) -> None:
        if self.table is not None:
            self.table.drop(self.store.engine)


@pytest.fixture(params=CASES, ids=[f"{k}-{m}" for k, m in CASES])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, str, Effects]]:
    kind, mode = request.param
    store = expiring_store(kind, tmp_path)
    effects = Effects(store, mode)
    yield store, mode, effects
    effects.drop()
    dispose(store)


def guard_of(store: Any, mode: str, consumer: str, clock: FakeClock) -> idemq.Idempotency:
    return idemq.Idempotency(store, consumer=consumer, mode=mode, lease_s=30, clock=clock)


def test_a_record_older_than_the_window_counts_as_absent(case):
    store, mode, effects = case
    clock = FakeClock(START_MS)
    guard = guard_of(store, mode, unique("c"), clock)

    first = guard.process("M1", effects.handler("M1", {"run": 1}))
    clock.advance(WINDOW_MS - 1000)  # still inside the window
    inside = guard.process("M1", effects.handler("M1", {"run": "never"}))
    clock.advance(2000)  # a second past it
    after = guard.process("M1", effects.handler("M1", {"run": 2}))
    again = guard.process("M1", effects.handler("M1", {"run": "never"}))

    assert first.status is idemq.Status.PROCESSED
    assert inside.status is idemq.Status.DUPLICATE
    assert inside.result == {"run": 1}
    assert after.status is idemq.Status.PROCESSED
    assert after.result == {"run": 2}
    assert again.status is idemq.Status.DUPLICATE  # the new record starts a new window
    assert again.result == {"run": 2}
    assert effects.count("M1") == 2


def test_another_payload_after_the_window_is_a_new_message_not_a_mismatch(case):
    store, mode, effects = case
    clock = FakeClock(START_MS)
    guard = guard_of(store, mode, unique("c"), clock)
    guard.process("M1", effects.handler("M1", "a"), payload={"amount": 1})
    with pytest.raises(idemq.PayloadMismatchError):
        guard.process("M1", effects.handler("M1", "b"), payload={"amount": 2})

    clock.advance(WINDOW_MS + 1000)
    out = guard.process("M1", effects.handler("M1", "b"), payload={"amount": 2})

    assert out.status is idemq.Status.PROCESSED
    assert effects.count("M1") == 2


@pytest.mark.parametrize("kind", SQL_STORES)
def test_a_failed_rerun_leaves_the_expired_record_as_it_was(kind, tmp_path):
    # Transactional mode: the expired record is deleted inside the business transaction, so a
    # handler that fails rolls the deletion back with everything else.
    store = expiring_store(kind, tmp_path)
    effects = Effects(store, "transactional")
    try:
        clock = FakeClock(START_MS)
        consumer = unique("c")
        guard = guard_of(store, "transactional", consumer, clock)
        guard.process("M1", effects.handler("M1", {"run": 1}))
        before = store.get("M1", consumer)
        clock.advance(WINDOW_MS + 1000)

        def fails(tx: Any) -> None:
            effects.handler("M1", None)(tx)
            raise RuntimeError("the rerun fails")

        with pytest.raises(RuntimeError):
            guard.process("M1", fails)

        kept = store.get("M1", consumer)
        assert kept is not None
        assert (kept.result, kept.processed_time) == (before.result, before.processed_time)
        assert effects.count("M1") == 1
        assert guard.process("M1", effects.handler("M1", {"run": 2})).result == {"run": 2}
        assert effects.count("M1") == 2
    finally:
        effects.drop()
        dispose(store)


def test_racing_deliveries_of_an_expired_message_run_it_once(case):
    store, mode, effects = case
    consumer = unique("c")
    clock = FakeClock(START_MS)
    guard_of(store, mode, consumer, clock).process("M1", effects.handler("M1", "old"))
    clock.advance(WINDOW_MS + 1000)

    workers = 8
    barrier = threading.Barrier(workers)
    outcomes: list[idemq.Status] = []
    errors: list[BaseException] = []

    def deliver() -> None:
        guard = guard_of(store, mode, consumer, clock)
        try:
            barrier.wait(10)
            outcomes.append(guard.process("M1", effects.handler("M1", "new")).status)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=deliver) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert errors == []
    assert outcomes.count(idemq.Status.PROCESSED) == 1
    assert len(outcomes) == workers
    assert effects.count("M1") == 2  # the first run, and one rerun after the window


LEASE_CASES = [(k, m) for k, m in CASES if m == "lease"]


@pytest.mark.parametrize(("kind", "mode"), LEASE_CASES, ids=[k for k, _ in LEASE_CASES])
def test_the_window_runs_from_the_completion_not_from_the_claim(kind, mode, tmp_path):
    # A handler that ran for two windows completed long after its claim: half a window after
    # the completion its record still answers DUPLICATE, although 2.5 windows passed since the
    # claim. Measured from the claim, the message would run a second time.
    store = expiring_store(kind, tmp_path)
    effects = Effects(store, mode)
    try:
        clock = FakeClock(START_MS)
        guard = idemq.Idempotency(
            store,
            consumer=unique("c"),
            mode=mode,
            lease_s=3 * WINDOW_S,  # the lease outlasts the long handler
            clock=clock,
            renew=False,
        )
        handle = effects.handler("M1", "slow")

        def slow(tx: Any) -> object:
            clock.advance(2 * WINDOW_MS)
            return handle(tx)

        first = guard.process("M1", slow)
        clock.advance(WINDOW_MS // 2)
        again = guard.process("M1", effects.handler("M1", "never"))

        assert first.status is idemq.Status.PROCESSED
        assert again.status is idemq.Status.DUPLICATE
        assert again.result == "slow"
        assert effects.count("M1") == 1
    finally:
        effects.drop()
        dispose(store)


def test_process_batch_honours_the_window(case):
    store, mode, effects = case
    consumer = unique("c")
    clock = FakeClock(START_MS)
    guard = guard_of(store, mode, consumer, clock)
    guard.process("OLD", effects.handler("OLD", "old"))
    clock.advance(WINDOW_MS + 1000)
    guard.process("FRESH", effects.handler("FRESH", "fresh"))

    def handle(msg: idemq.Message, tx: Any) -> str:
        return str(effects.handler(msg.id, f"batch {msg.id}")(tx))

    batch = [idemq.Message(id=i, body=b"{}") for i in ("OLD", "FRESH", "NEW")]
    outcomes = guard.process_batch(batch, handle)

    assert [o.status for o in outcomes] == [
        idemq.Status.PROCESSED,
        idemq.Status.DUPLICATE,
        idemq.Status.PROCESSED,
    ]
    assert outcomes[1].result == "fresh"
    assert [effects.count(i) for i in ("OLD", "FRESH", "NEW")] == [2, 1, 1]


@pytest.mark.parametrize("kind", ["postgres", "mariadb"])
def test_the_window_holds_on_a_store_with_server_clock_leases(kind, tmp_path):
    # processed_time is the database server's; the window is judged on the guard's clock.
    store = expiring_store(kind, tmp_path, lease_clock="store")
    try:
        clock = FakeClock(time.time_ns() // 1_000_000)
        guard = guard_of(store, "lease", unique("c"), clock)
        runs: list[int] = []
        guard.process("M1", lambda _tx: runs.append(1))
        assert guard.process("M1", lambda _tx: runs.append(2)).status is idemq.Status.DUPLICATE
        clock.advance(WINDOW_MS + 60_000)
        assert guard.process("M1", lambda _tx: runs.append(3)).status is idemq.Status.PROCESSED
        assert runs == [1, 3]
    finally:
        dispose(store)


@pytest.mark.parametrize("bad", [0, -1, "3600", True, float("nan")])
def test_expires_after_s_must_be_a_positive_number(bad, tmp_path):
    with pytest.raises(idemq.ConfigurationError, match="expires_after_s"):
        idemq.MemoryStore(expires_after_s=bad)
    with pytest.raises(idemq.ConfigurationError, match="expires_after_s"):
        idemq.SqlStore(f"sqlite:///{tmp_path / 'x.db'}", expires_after_s=bad)


def test_on_redis_the_window_is_the_record_ttl():
    require_service("redis")
    store = idemq.RedisStore(REDIS_URL, prefix=unique("idemqtest"), ttl_s=1)
    try:
        consumer = unique("c")
        guard = idemq.Idempotency(store, consumer=consumer, lease_s=30)
        runs: list[int] = []
        guard.process("M1", lambda _tx: runs.append(1))
        assert guard.process("M1", lambda _tx: runs.append(2)).status is idemq.Status.DUPLICATE
        # Redis expires the key on its own clock, about a second from now.
        wait_until(lambda: store.get("M1", consumer) is None, "Redis to expire M1", timeout_s=10)
        assert guard.process("M1", lambda _tx: runs.append(3)).status is idemq.Status.PROCESSED
        assert runs == [1, 3]
    finally:
        dispose(store)


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mariadb"])
@pytest.mark.parametrize("mode", ["lease", "transactional"])
async def test_the_async_store_honours_the_window(kind, mode, tmp_path):
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'async.db'}"
    else:
        require_service("postgres" if kind == "postgres" else "mysql")
        url = PG_URL if kind == "postgres" else MYSQL_URL
    store = idemq.AsyncSqlStore(
        url, table=unique("mi"), lease_clock=LEASE_CLOCK, expires_after_s=WINDOW_S
    )
    await store.create_schema()
    try:
        clock = FakeClock(START_MS)
        guard = idemq.AsyncIdempotency(store, consumer=unique("c"), mode=mode, clock=clock)
        runs: list[int] = []

        async def run(n: int) -> idemq.Status:
            async def handle(_tx: Any) -> int:
                runs.append(n)
                return n

            return (await guard.process("M1", handle)).status

        assert await run(1) is idemq.Status.PROCESSED
        assert await run(2) is idemq.Status.DUPLICATE
        clock.advance(WINDOW_MS + 1000)
        assert await run(3) is idemq.Status.PROCESSED
        assert await run(4) is idemq.Status.DUPLICATE
        assert runs == [1, 3]
    finally:
        await store.drop_schema()
        await store.close()
