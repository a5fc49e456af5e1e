"""Try to break transactional exactly-once: racing workers and SIGKILL mid-transaction.

Each test asserts on the business table: every message id's effect is there exactly once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

WORKERS = 8
IDS = [f"ORDER_20240115143000{i:03d}_NODE01_{i:04d}" for i in range(500)]


def effects_table(name: str) -> sa.Table:
    # No unique constraint on purpose: only the guard stands between a duplicate and a 2nd row.
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(128), nullable=False),
        sa.Column("worker", sa.Integer, nullable=False),
    )


@pytest.fixture(params=["sqlite", "postgres", "mariadb"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """(url, dedup table, effects table) on one SQL backend, cleaned up afterwards."""
    kind = request.param
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'race.db'}"
    else:
        require_service("postgres" if kind == "postgres" else "mysql")
        url = PG_URL if kind == "postgres" else MYSQL_URL
    store = idemq.SqlStore(url, table=unique("mi"))
    store.create_schema()
    effects = effects_table(unique("effects"))
    effects.create(store.engine)
    yield url, store.table.name, effects
    effects.drop(store.engine)
    store.drop_schema()
    store.close()


def deliver_all(url: str, table: str, effects: sa.Table, worker: int, ids: list[str]) -> int:
    """One worker delivering every id; returns how many it PROCESSED."""
    store = idemq.SqlStore(url, table=table, pool_size=1, max_overflow=0)
    guard = idemq.Idempotency(store, consumer="race")
    processed = 0
    try:
        for message_id in ids:

            def handler(tx: sa.Connection, message_id: str = message_id) -> None:
                tx.execute(effects.insert().values(message_id=message_id, worker=worker))

            if guard.process(message_id, handler).status is idemq.Status.PROCESSED:
                processed += 1
    finally:
        store.close()
    return processed


def effect_counts(url: str, effects: sa.Table) -> Counter[str]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        counts = Counter(r[0] for r in conn.execute(sa.select(effects.c.message_id)))
    engine.dispose()
    return counts


def assert_each_once(url: str, effects: sa.Table) -> None:
    counts = effect_counts(url, effects)
    assert set(counts) == set(IDS), "every message's effect must be there"
    doubled = {k: v for k, v in counts.items() if v != 1}
    assert not doubled, f"effects applied more than once: {dict(list(doubled.items())[:5])}"


@pytest.mark.slow
def test_racing_threads_apply_each_message_once(backend):
    url, table, effects = backend
    results: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(WORKERS)

    def worker(n: int) -> None:
        start.wait()
        try:
            results.append(deliver_all(url, table, effects, n, IDS))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not errors, errors
    assert sum(results) == len(IDS), "exactly one PROCESSED outcome per id across workers"
    assert_each_once(url, effects)


def _process_worker(url: str, table: str, effects_name: str, n: int, out: Any) -> None:
    out.put(deliver_all(url, table, effects_table(effects_name), n, IDS))


@pytest.mark.slow
def test_racing_processes_apply_each_message_once(backend):
    url, table, effects = backend
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process_worker, args=(url, table, effects.name, n, out))
        for n in range(WORKERS)
    ]
    for p in procs:
        p.start()
    counts = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    assert sum(counts) == len(IDS)
    assert_each_once(url, effects)


def _crash_inside_handler(url: str, table: str, effects_name: str) -> None:
    store = idemq.SqlStore(url, table=table)
    guard = idemq.Idempotency(store, consumer="race")
    effects = effects_table(effects_name)

    def handler(tx: sa.Connection) -> None:
        tx.execute(effects.insert().values(message_id=IDS[0], worker=1))
        # The worst moment: the business write is done, the commit is not.
        os.kill(os.getpid(), signal.SIGKILL)

    guard.process(IDS[0], handler)


def test_sigkill_after_the_business_write_leaves_nothing_and_redelivery_applies_once(backend):
    url, table, effects = backend
    child = multiprocessing.get_context("fork").Process(
        target=_crash_inside_handler, args=(url, table, effects.name)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL

    store = idemq.SqlStore(url, table=table)
    try:
        assert store.get(IDS[0], "race") is None, "no dedup row may survive the crash"
        assert effect_counts(url, effects) == Counter(), "no effect may survive the crash"

        guard = idemq.Idempotency(store, consumer="race")

        def apply(tx: sa.Connection) -> None:
            tx.execute(effects.insert().values(message_id=IDS[0], worker=2))

        redelivered = guard.process(IDS[0], apply)
        again = guard.process(IDS[0], lambda tx: pytest.fail("must not run twice"))
    finally:
        store.close()
    assert redelivered.status is idemq.Status.PROCESSED
    assert again.status is idemq.Status.DUPLICATE
    assert effect_counts(url, effects) == Counter({IDS[0]: 1})
