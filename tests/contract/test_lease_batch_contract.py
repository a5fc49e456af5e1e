"""Lease-mode ``process_batch`` longer than its lease: every claim the batch holds stays its own.

A batch claims all its messages up front. Before the fix only the running handler's claim was
renewed, so a batch longer than ``lease_s`` let a rival take a later message over and complete
it — and then the batch ran that message's handler too: two effects. Now every claim the batch
still holds is renewed while it runs, and each message's claim is checked on the store right
before its handler starts (lost: IN_PROGRESS, not run).

Real time on Redis, PostgreSQL and MariaDB: 1 s leases, handlers of 1.3 s, a rival delivering
the later messages the whole time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import REDIS_URL, unique
from tests.contract.conftest import dispose, make_store

LEASE_S = 1.0
HANDLER_S = 1.3  # each handler outlives the lease


@pytest.fixture(params=["redis", "postgres", "mariadb"])
def lease_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = make_store(request.param, tmp_path, request)
    yield made
    dispose(made)


class Effects:
    """The business effect of a message: a row in a table of the store's database, or an
    increment of a Redis hash field (lease mode: the effect is never in the dedup transaction)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.sql = isinstance(store, idemq.SqlStore)
        if self.sql:
            self.table = unique("fx")
            with store.engine.begin() as conn:
                conn.execute(sa.text(f"CREATE TABLE {self.table} (message_id VARCHAR(64))"))
        else:
            import redis  # noqa: PLC0415

            self.key = unique("idemqtest_fx")
            self.client = redis.Redis.from_url(REDIS_URL)

    def apply(self, message_id: str) -> None:
        if self.sql:
            with self.store.engine.begin() as conn:
                conn.execute(sa.text(f"INSERT INTO {self.table} VALUES (:m)"), {"m": message_id})
        else:
            self.client.hincrby(self.key, message_id, 1)

    def counts(self) -> Counter[str]:
        if self.sql:
            with self.store.engine.connect() as conn:
                return Counter(r[0] for r in conn.execute(sa.text(f"SELECT * FROM {self.table}")))
        return Counter({k.decode(): int(v) for k, v in self.client.hgetall(self.key).items()})

    def drop(self) -> None:
        if self.sql:
            with self.store.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE {self.table}"))
        else:
            self.client.delete(self.key)
            self.client.close()


@pytest.fixture
def effects(lease_store: Any) -> Iterator[Effects]:
    fx = Effects(lease_store)
    yield fx
    fx.drop()


def messages(n: int) -> list[idemq.Message]:
    return [idemq.Message(id=f"B{i}", body=b"{}") for i in range(n)]


class Rival:
    """Another worker delivering ``ids`` over and over until stopped, with a fast handler."""

    def __init__(self, guard: idemq.Idempotency, effects: Effects, ids: list[str]) -> None:
        self.guard, self.effects, self.ids = guard, effects, ids
        self.statuses: Counter[idemq.Status] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for message_id in self.ids:
                outcome = self.guard.process(
                    message_id, lambda _tx, m=message_id: self.effects.apply(m)
                )
                self.statuses[outcome.status] += 1
            self.stop.wait(0.05)

    def start(self) -> None:
        """Start racing (from the batch's first handler: the batch has claimed everything)."""
        if not self.thread.is_alive():
            self.thread.start()

    def __enter__(self) -> Rival:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(30)


def slow_handler(effects: Effects, runs: Counter[str], rival: Rival) -> Any:
    def handle(msg: idemq.Message, _tx: Any) -> str:
        runs[msg.id] += 1
        rival.start()
        time.sleep(HANDLER_S)
        effects.apply(msg.id)
        return msg.id

    return handle


@pytest.mark.slow
def test_a_batch_longer_than_its_lease_keeps_every_claim_it_holds(lease_store, effects):
    consumer = unique("c")
    batch = messages(3)
    worker = idemq.Idempotency(lease_store, consumer=consumer, mode="lease", lease_s=LEASE_S)
    rival = idemq.Idempotency(lease_store, consumer=consumer, mode="lease", lease_s=LEASE_S)
    runs: Counter[str] = Counter()

    with Rival(rival, effects, [m.id for m in batch[1:]]) as racing:
        outcomes = worker.process_batch(batch, slow_handler(effects, runs, racing))

    assert effects.counts() == Counter({m.id: 1 for m in batch})  # each effect exactly once
    assert runs == Counter({m.id: 1 for m in batch})
    assert [o.status for o in outcomes] == [idemq.Status.PROCESSED] * 3
    # The rival met the batch's live claims the whole time, then its completed records.
    assert racing.statuses[idemq.Status.PROCESSED] == 0
    assert racing.statuses[idemq.Status.IN_PROGRESS] > 0


def test_a_later_message_taken_over_while_unrenewed_is_not_run_by_the_batch(lease_store, effects):
    # Renewal off: the later claims expire while the first handler runs, and the rival takes
    # them over and completes them. The check right before each handler finds the claim gone.
    consumer = unique("c")
    batch = messages(3)
    worker = idemq.Idempotency(
        lease_store, consumer=consumer, mode="lease", lease_s=LEASE_S, renew=False
    )
    rival = idemq.Idempotency(lease_store, consumer=consumer, mode="lease", lease_s=LEASE_S)
    runs: Counter[str] = Counter()
    taken = threading.Event()

    def handle(msg: idemq.Message, _tx: Any) -> str:
        runs[msg.id] += 1
        if msg.id == "B0":
            # Past the later messages' leases, the rival delivers them, takes them over and
            # completes them (until then its deliveries meet the batch's live claims).
            deadline = time.monotonic() + 10 * LEASE_S
            while time.monotonic() < deadline and not taken.is_set():
                for later in ("B1", "B2"):
                    if effects.counts()[later] == 0:
                        rival.process(later, lambda _tx, m=later: effects.apply(m))
                if all(effects.counts()[m] == 1 for m in ("B1", "B2")):
                    taken.set()
                time.sleep(0.05)
        effects.apply(msg.id)
        return msg.id

    outcomes = worker.process_batch(batch, handle)

    assert taken.is_set()
    assert effects.counts() == Counter({m.id: 1 for m in batch})  # each effect exactly once
    assert runs == Counter({"B0": 1})  # the batch never ran the messages the rival took
    assert outcomes[0].status is idemq.Status.PROCESSED
    for outcome in outcomes[1:]:
        assert outcome.status in (idemq.Status.IN_PROGRESS, idemq.Status.DUPLICATE)


@pytest.mark.slow
def test_an_async_batch_longer_than_its_lease_keeps_every_claim_it_holds(tmp_path):
    # The asyncio guard holds the later claims with a task each (AsyncHolding).
    store = make_store("redis", tmp_path)
    fx = Effects(store)
    consumer = unique("c")
    batch = messages(3)
    rival = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S)
    runs: Counter[str] = Counter()

    async def main(racing: Rival) -> list[idemq.Outcome[Any]]:
        async_store = idemq.AsyncRedisStore(REDIS_URL, prefix=store.prefix)
        worker = idemq.AsyncIdempotency(
            async_store, consumer=consumer, mode="lease", lease_s=LEASE_S
        )

        async def handle(msg: idemq.Message, _tx: Any) -> str:
            runs[msg.id] += 1
            racing.start()
            await asyncio.sleep(HANDLER_S)
            fx.apply(msg.id)
            return msg.id

        try:
            return await worker.process_batch(batch, handle)
        finally:
            await async_store.close()

    try:
        with Rival(rival, fx, [m.id for m in batch[1:]]) as racing:
            outcomes = asyncio.run(main(racing))
        assert fx.counts() == Counter({m.id: 1 for m in batch})  # each effect exactly once
        assert runs == Counter({m.id: 1 for m in batch})
        assert [o.status for o in outcomes] == [idemq.Status.PROCESSED] * 3
    finally:
        fx.drop()
        dispose(store)
