"""The outbox table and ``add`` on SQLite, PostgreSQL and MariaDB, sync and async, and the relay
end to end on the embedded broker (the other brokers: test_outbox_relay.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import Broker
from idemq.outbox import outbox_stats, retry_dead
from tests.conftest import unique


@pytest.fixture
def outbox(sql_url: str) -> Iterator[idemq.Outbox]:
    store = idemq.SqlStore(sql_url)
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    opened = open_broker(f"embedded://{tmp_path / 'queue.db'}")
    yield opened
    opened.close()


def drain(broker: Broker, queue: str) -> list[tuple[str, bytes, dict[str, str]]]:
    got = []
    for delivery in broker.consume(queue, prefetch=50):
        if delivery is None:
            break
        assert delivery.message is not None
        got.append((delivery.message.id, delivery.body, dict(delivery.headers)))
        delivery.ack()
    return got


def rows(box: idemq.Outbox) -> list[str]:
    with box.engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {box.table} ORDER BY seq"))]


def test_create_schema_twice_and_adopts_a_table_missing_an_index(outbox: idemq.Outbox) -> None:
    outbox.create_schema()
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"DROP INDEX ix_{outbox.table}_key"
                + (f" ON {outbox.table}" if conn.dialect.name in ("mysql", "mariadb") else "")
            )
        )
    outbox.create_schema()
    names = {ix["name"] for ix in sa.inspect(outbox.engine).get_indexes(outbox.table)}
    assert f"ix_{outbox.table}_key" in names


def test_a_foreign_table_without_our_columns_is_refused(sql_url: str) -> None:
    store = idemq.SqlStore(sql_url)
    name = unique("ob")
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} (id VARCHAR(128) PRIMARY KEY)"))
    try:
        with pytest.raises(idemq.ConfigurationError, match="destination"):
            idemq.Outbox(store, table=name).create_schema()
    finally:
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {name}"))
        store.close()


def test_add_commits_and_rolls_back_with_the_business_change(outbox: idemq.Outbox) -> None:
    with outbox.engine.begin() as conn:
        kept = outbox.add(conn, "shipments", b"ship 1", headers={"k": "v"}, ordering_key="o1")

    def failing_handler() -> None:
        with outbox.engine.begin() as conn:
            outbox.add(conn, "shipments", b"ship 2")
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        failing_handler()
    assert rows(outbox) == [kept]


def test_add_under_a_callers_id_adds_it_once_waiting_kept_or_dead(
    outbox: idemq.Outbox, broker: Broker
) -> None:
    queue = unique("q")
    for _ in range(2):
        with outbox.engine.begin() as conn:
            assert outbox.add(conn, queue, b"once", message_id="MINE-1") == "MINE-1"
    assert rows(outbox) == ["MINE-1"]
    relay = idemq.OutboxRelay(outbox, broker, keep_sent_s=60)
    relay.run_once()  # sent, kept for audit: still not added again
    with outbox.engine.begin() as conn:
        outbox.add(conn, queue, b"once", message_id="MINE-1")
    relay.run_once()
    relay.close()
    assert [(i, b) for i, b, _ in drain(broker, queue)] == [("MINE-1", b"once")]
    for bad in ("", "x" * 129, 7):
        with outbox.engine.begin() as conn, pytest.raises(idemq.errors.InvalidInputError):
            outbox.add(conn, queue, b"x", message_id=bad)  # type: ignore[arg-type]


def test_add_through_an_orm_session(outbox: idemq.Outbox) -> None:
    with Session(outbox.engine) as session:
        first = outbox.add(session, "shipments", b"a")
        second = outbox.add(session, "shipments", b"b")
        session.commit()
    assert rows(outbox) == [first, second]


def test_handler_rollback_leaves_no_row_and_a_rerun_makes_the_same_ids(
    outbox: idemq.Outbox, sql_url: str
) -> None:
    guard = idemq.Idempotency(outbox.store, consumer="pay")
    outbox.store.create_schema()
    made: list[list[str]] = []

    def pay(tx: sa.Connection) -> None:
        ids = [outbox.add(tx, "shipments", b"ship o1", ordering_key="o1") for _ in range(2)]
        made.append(ids)
        if len(made) == 1:
            raise RuntimeError("crash before commit")

    message = "PAY_20240115143000123_NODE01_0001"
    with pytest.raises(RuntimeError):
        guard.process(message, pay)
    assert rows(outbox) == []
    assert guard.process(message, pay).status is idemq.Status.PROCESSED
    assert made[0] == made[1]
    assert made[0][0] != made[0][1]
    assert rows(outbox) == made[1]
    assert all(len(i) <= 128 for i in made[1])
    assert guard.process(message, pay).status is idemq.Status.DUPLICATE
    assert rows(outbox) == made[1]
    outbox.store.drop_schema()


def test_async_add(sql_url: str) -> None:
    name = unique("ob")
    store = idemq.AsyncSqlStore(sql_url)
    box = idemq.AsyncOutbox(store, table=name)

    async def scenario() -> list[str]:
        await box.create_schema()
        await box.create_schema()
        async with store.engine.begin() as conn:
            made = [await box.add(conn, "q", b"x", ordering_key="k")]
        async with AsyncSession(store.engine) as session, session.begin():
            made.append(await box.add(session, "q", b"through a session"))

        async def failing_handler() -> None:
            async with store.engine.begin() as conn:
                await box.add(conn, "q", b"y")
                raise RuntimeError

        with pytest.raises(RuntimeError):
            await failing_handler()
        await store.engine.dispose()
        return made

    made = asyncio.run(scenario())
    sync_store = idemq.SqlStore(sql_url)
    sync_box = idemq.Outbox(sync_store, table=name)
    try:
        assert rows(sync_box) == made
    finally:
        sync_box.drop_schema()
        sync_store.close()


def test_relay_publishes_in_order_per_key_with_the_id_header(
    outbox: idemq.Outbox, broker: Broker
) -> None:
    queue = unique("q")
    with outbox.engine.begin() as conn:
        made = [
            outbox.add(
                conn, queue, f"{i}".encode(), headers={"n": str(i)}, ordering_key=f"k{i % 2}"
            )
            for i in range(6)
        ]
        free = outbox.add(conn, queue, b"free")
    relay = idemq.OutboxRelay(outbox, broker, batch_size=10)
    while relay.run_once().claimed:
        pass
    got = drain(broker, queue)
    assert sorted(g[0] for g in got) == sorted([*made, free])
    for key in ("0", "1"):
        ids = [g[0] for g in got if g[2].get("n") and int(g[2]["n"]) % 2 == int(key)]
        assert ids == [m for i, m in enumerate(made) if i % 2 == int(key)]
    assert all(g[2]["idemq-message-id"] == g[0] for g in got)
    relay.close()
    assert rows(outbox) == []
    assert relay.published_total == 7
    assert outbox_stats(outbox).pending == 0


def test_keep_sent_rows_then_cleanup_in_batches(outbox: idemq.Outbox, broker: Broker) -> None:
    queue = unique("q")
    with outbox.engine.begin() as conn:
        for i in range(5):
            outbox.add(conn, queue, b"%d" % i)
    now = [outbox.clock()]
    relay = idemq.OutboxRelay(outbox, broker, keep_sent_s=60, cleanup_batch=2, clock=lambda: now[0])
    relay.run_once()
    assert len(rows(outbox)) == 5
    assert outbox_stats(outbox).pending == 0
    assert relay.cleanup() == 0
    now[0] += 61_000
    assert relay.cleanup() == 5
    relay.close()
    assert rows(outbox) == []


class RefusingBroker:
    """The real embedded broker, refusing one destination (a refusal, not an outage)."""

    def __init__(self, inner: Broker, refused: str) -> None:
        self.inner = inner
        self.refused = refused

    def publish(self, queue: str, body: bytes, **kw: object) -> None:
        if queue == self.refused:
            raise idemq.errors.BrokerError(f"no such destination {queue!r}")
        self.inner.publish(queue, body, **kw)  # type: ignore[arg-type]

    def close(self) -> None:
        return None


def test_refused_row_backs_off_then_goes_dead_holding_back_only_its_key(
    outbox: idemq.Outbox, broker: Broker
) -> None:
    good, bad = unique("q"), unique("bad")
    with outbox.engine.begin() as conn:
        doomed = outbox.add(conn, bad, b"never", ordering_key="k")
        behind = outbox.add(conn, good, b"after", ordering_key="k")
        other = outbox.add(conn, good, b"other", ordering_key="j")
    now = [outbox.clock()]
    relay = idemq.OutboxRelay(
        outbox, RefusingBroker(broker, bad), max_attempts=3, backoff_s=1, clock=lambda: now[0]
    )  # type: ignore[arg-type]
    first = relay.run_once()
    assert first.published == [other]
    assert first.retried == [doomed]
    assert relay.run_once().claimed == 0  # backing off; `behind` waits for its key
    now[0] += 2_000
    assert relay.run_once().retried == [doomed]
    now[0] += 4_000
    last = relay.run_once()
    assert last.dead == [doomed]
    assert outbox_stats(outbox).dead == 1
    # The key moves on once its head is dead (in the same batch where rows are locked).
    assert [*last.published, *relay.run_once().published] == [behind]
    with outbox.engine.connect() as conn:
        reason = conn.execute(sa.text(f"SELECT last_error FROM {outbox.table}_dead")).scalar_one()
    assert "no such destination" in reason
    with outbox.engine.begin() as conn:  # dead, not gone: the caller's id is not added again
        assert outbox.add(conn, bad, b"never", message_id=doomed) == doomed
    assert rows(outbox) == []
    assert retry_dead(outbox, doomed)
    assert not retry_dead(outbox, doomed)
    relay.close()
    fixed = idemq.OutboxRelay(outbox, broker, clock=lambda: now[0])
    assert fixed.run_once().published == [doomed]
    fixed.close()
    assert [g[0] for g in drain(broker, bad)] == [doomed]
    assert outbox_stats(outbox).dead == 0


def test_three_relays_on_each_database_publish_each_row_once_in_key_order(
    outbox: idemq.Outbox, tmp_path: Path
) -> None:
    queue, url = unique("q"), f"embedded://{tmp_path / 'many.db'}"
    with outbox.engine.begin() as conn:
        for n in range(40):
            for k in range(5):
                body = json.dumps({"k": k, "n": n}).encode()
                outbox.add(conn, queue, body, ordering_key=f"k{k}")
    stop = threading.Event()
    relays = [idemq.OutboxRelay(outbox, url, batch_size=7, poll_s=0.05) for _ in range(3)]
    threads = [threading.Thread(target=r.run, args=(stop,)) for r in relays]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while outbox_stats(outbox).pending and time.monotonic() < deadline:
            stop.wait(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        for relay in relays:
            relay.close()
    reader = open_broker(url)
    try:
        got = [json.loads(body) for _, body, _ in drain(reader, queue)]
    finally:
        reader.close()
    assert len(got) == 200
    for k in range(5):
        assert [g["n"] for g in got if g["k"] == k] == list(range(40))
    assert sum(r.published_total for r in relays) == 200
