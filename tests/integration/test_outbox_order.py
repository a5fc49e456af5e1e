"""PostgreSQL: producers racing on one ordering key, committing in either order; the relay
publishes each key's rows in the order their transactions committed (``add``'s per-key lock)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import idemq
from idemq.brokers import open_broker
from idemq.outbox import outbox_stats
from tests.conftest import PG_URL, require_service, unique
from tests.integration.test_outbox import drain


@pytest.fixture
def outbox() -> Iterator[idemq.Outbox]:
    require_service("postgres")
    store = idemq.SqlStore(PG_URL)
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


def _waiting_on_a_lock(engine: sa.Engine, pid: int) -> bool:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid AND wait_event_type = 'Lock'"),
            {"pid": pid},
        ).first()
    return found is not None


def _race(box: idemq.Outbox, queue: str, key: str, second_commits_first: bool) -> list[str]:
    """Two transactions add a row of ``key`` (the first adds first); the second tries to commit
    before the first when ``second_commits_first``. The bodies in the order of the commits."""
    committed: list[str] = []
    first = box.engine.connect()
    second = box.engine.connect()
    try:
        first.begin()
        box.add(first, queue, b"first:" + key.encode(), ordering_key=key)
        pid = second.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        second.rollback()

        def second_writer() -> None:
            second.begin()
            box.add(second, queue, b"second:" + key.encode(), ordering_key=key)
            second.commit()
            committed.append("second")

        thread = threading.Thread(target=second_writer)
        thread.start()
        if second_commits_first:
            # Wait until the second has committed, or is held back by the first: then commit.
            deadline = time.monotonic() + 30
            while thread.is_alive() and not _waiting_on_a_lock(box.engine, pid):
                assert time.monotonic() < deadline, "second writer neither done nor waiting"
                time.sleep(0.01)
        # The second commits before the first only if it already has: otherwise the first's
        # row lock holds it until this commit. Noted before committing, since the second's own
        # note may land first once the lock is gone.
        second_went_first = "second" in committed
        first.commit()
        committed.insert(1 if second_went_first else 0, "first")
        thread.join(30)
        assert not thread.is_alive()
    finally:
        first.close()
        second.close()
    return [f"{name}:{key}" for name in committed]


@pytest.mark.parametrize("second_commits_first", [False, True])
def test_racing_producers_of_one_key_are_published_in_commit_order(
    outbox: idemq.Outbox, tmp_path: Path, second_commits_first: bool
) -> None:
    queue, url = unique("q"), f"embedded://{tmp_path / 'queue.db'}"
    expected: dict[str, list[str]] = {}
    for n in range(5):
        key = f"k{n}"
        expected[key] = _race(outbox, queue, key, second_commits_first)
    relay = idemq.OutboxRelay(outbox, url)
    try:
        while outbox_stats(outbox).pending:
            relay.run_once()
    finally:
        relay.close()
    reader = open_broker(url)
    try:
        got = [body.decode() for _, body, _ in drain(reader, queue)]
    finally:
        reader.close()
    for key, order in expected.items():
        assert [g for g in got if g.endswith(f":{key}")] == order, key
