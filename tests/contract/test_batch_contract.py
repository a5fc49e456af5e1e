"""``process_batch`` keeps ``process``'s guarantees: races, poison messages, a crash mid-batch.

Transactional mode on every SQL store, lease mode on Redis. Effects are rows in a business table
(written through ``tx``) or, for Redis, increments of a Redis counter per message id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import REDIS_URL, require_service, unique
from tests.contract.conftest import SQL_STORES, dispose, make_store

IDS = [f"M{i:04d}" for i in range(500)]


@pytest.fixture(params=[*SQL_STORES, "redis", "redis-cluster"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = make_store(request.param, tmp_path, request)
    yield made
    dispose(made)


class Effects:
    """Where a handler's effect lands: a table in the store's database, or a Redis hash."""

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

    def handler(self, msg: idemq.Message, tx: Any) -> int:
        if msg.body == b"poison":
            if self.sql:  # write first: the write must roll back with the failure
                self.write(msg.id, tx)
            raise RuntimeError("poison message")
        self.write(msg.id, tx)
        return len(msg.id)

    def write(self, message_id: str, tx: Any) -> None:
        if self.sql:
            tx.execute(sa.text(f"INSERT INTO {self.table} VALUES (:m)"), {"m": message_id})
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
def effects(any_store: Any) -> Iterator[Effects]:
    fx = Effects(any_store)
    yield fx
    fx.drop()


def guard_for(store: Any, consumer: str) -> idemq.Idempotency:
    if isinstance(store, idemq.SqlStore):
        return idemq.Idempotency(store, consumer=consumer)
    return idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=60)


@pytest.mark.slow
def test_four_workers_race_on_the_same_500_ids_in_batches_of_50(any_store, effects):
    consumer = unique("c")
    failures: list[BaseException] = []
    statuses: Counter[str] = Counter()
    lock = threading.Lock()

    def worker(seed: int) -> None:
        guard = guard_for(any_store, consumer)
        # Each worker walks the ids in its own order, so batches overlap differently.
        ids = IDS[seed * 125 :] + IDS[: seed * 125]
        pending = list(ids)
        try:
            while pending:
                retry = []
                for start in range(0, len(pending), 50):
                    chunk = [idemq.Message(id=i, body=b"x") for i in pending[start : start + 50]]
                    for msg, out in zip(
                        chunk, guard.process_batch(chunk, effects.handler), strict=True
                    ):
                        with lock:
                            statuses[out.status.value] += 1
                        if out.status is idemq.Status.IN_PROGRESS:  # a twin holds the lease
                            retry.append(msg.id)
                pending = retry
                if pending:
                    time.sleep(0.05)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert effects.counts() == Counter({i: 1 for i in IDS})
    assert statuses["processed"] == 500
    assert statuses["failed"] == 0


def test_a_poison_message_fails_alone_and_its_claim_is_undone(any_store, effects):
    guard = guard_for(any_store, unique("c"))
    batch = [
        idemq.Message(id="A", body=b"a"),
        idemq.Message(id="P", body=b"poison"),
        idemq.Message(id="B", body=b"b"),
    ]
    outcomes = guard.process_batch(batch, effects.handler)
    assert [o.status for o in outcomes] == [
        idemq.Status.PROCESSED,
        idemq.Status.FAILED,
        idemq.Status.PROCESSED,
    ]
    assert isinstance(outcomes[1].error, RuntimeError)
    assert effects.counts() == Counter({"A": 1, "B": 1})  # P's write rolled back
    again = guard.process_batch(
        [idemq.Message(id="A", body=b"a"), idemq.Message(id="P", body=b"fixed")], effects.handler
    )
    assert [o.status for o in again] == [idemq.Status.DUPLICATE, idemq.Status.PROCESSED]
    assert again[0].result == 1  # replayed
    assert effects.counts() == Counter({"A": 1, "B": 1, "P": 1})


def test_a_second_poison_message_fails_in_the_isolated_pass_and_its_claim_is_undone(
    any_store, effects
):
    # The first poison message ends the savepoint-free pass and is not claimed again; the
    # second one fails inside the isolated pass, after its claim: that claim must be released,
    # or its retry would read as a duplicate of a message whose effect never committed.
    guard = guard_for(any_store, unique("c"))
    batch = [
        idemq.Message(id="P1", body=b"poison"),
        idemq.Message(id="A", body=b"a"),
        idemq.Message(id="P2", body=b"poison"),
    ]
    outcomes = guard.process_batch(batch, effects.handler)
    assert [o.status for o in outcomes] == [
        idemq.Status.FAILED,
        idemq.Status.PROCESSED,
        idemq.Status.FAILED,
    ]
    assert effects.counts() == Counter({"A": 1})
    retried = guard.process_batch(
        [idemq.Message(id="P1", body=b"fixed"), idemq.Message(id="P2", body=b"fixed")],
        effects.handler,
    )
    assert [o.status for o in retried] == [idemq.Status.PROCESSED, idemq.Status.PROCESSED]
    assert effects.counts() == Counter({"A": 1, "P1": 1, "P2": 1})


CRASHER = textwrap.dedent(
    """
    import os, sys, time
    import sqlalchemy as sa
    import idemq
    store = idemq.SqlStore(sys.argv[1], table=sys.argv[2])
    guard = idemq.Idempotency(store, consumer="crash")
    seen = []
    def handle(msg, tx):
        tx.execute(sa.text(f"INSERT INTO {sys.argv[3]} VALUES (:m)"), {"m": msg.id})
        seen.append(msg.id)
        if len(seen) == 30:
            print("MIDWAY", flush=True)
            time.sleep(60)  # SIGKILLed here: 30 effects written, nothing committed
    guard.process_batch([idemq.Message(id=f"K{i:02d}", body=b"x") for i in range(50)], handle)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mariadb"])
def test_sigkill_mid_batch_commits_nothing_and_redelivery_applies_each_once(kind, tmp_path):
    if kind == "postgres":
        require_service("postgres")
    if kind == "mariadb":
        require_service("mysql")
    store = make_store(kind, tmp_path)
    effects = Effects(store)
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
        url = store.engine.url.render_as_string(hide_password=False)
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHER, url, store.table.name, effects.table],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "MIDWAY"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        assert effects.counts() == Counter()  # nothing of the batch committed
        guard = idemq.Idempotency(store, consumer="crash")
        redelivered = [idemq.Message(id=f"K{i:02d}", body=b"x") for i in range(50)]
        outcomes = guard.process_batch(redelivered, effects.handler)
        assert {o.status for o in outcomes} == {idemq.Status.PROCESSED}
        again = guard.process_batch(redelivered, effects.handler)
        assert {o.status for o in again} == {idemq.Status.DUPLICATE}
        assert effects.counts() == Counter({m.id: 1 for m in redelivered})
    finally:
        effects.drop()
        dispose(store)


def test_a_failure_in_the_savepoint_free_pass_is_reported_not_retried(any_store, effects):
    # The batch runs without savepoints first; a handler that raises there must end FAILED
    # (as with savepoints from the start), even if it would succeed on a second call.
    guard = guard_for(any_store, unique("c"))
    calls: Counter[str] = Counter()

    def flaky(msg: idemq.Message, tx: Any) -> None:
        calls[msg.id] += 1
        if msg.id == "F" and calls["F"] == 1:
            raise RuntimeError("transient")
        effects.write(msg.id, tx)

    batch = [idemq.Message(id=i, body=b"x") for i in ("A", "F", "B")]
    outcomes = guard.process_batch(batch, flaky)
    assert [o.status.value for o in outcomes] == ["processed", "failed", "processed"]
    assert calls["F"] == 1
    assert effects.counts() == Counter({"A": 1, "B": 1})
