"""Outgoing ids: a handler run again after ``forget`` (or an expiry) sends its message again
(its add no longer fails on the id of the earlier run),
concurrent adds under one caller's id make one row and no error, and derived ids cannot collide
(the parts are length-prefixed before hashing)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import idemq
from idemq.brokers import open_broker
from idemq.outbox import outbox_stats, retry_dead
from idemq.outbox.ids import derived_id
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique
from tests.integration.test_outbox import RefusingBroker, drain, rows


@pytest.fixture
def outbox(sql_url: str) -> Iterator[idemq.Outbox]:
    store = idemq.SqlStore(sql_url, table=unique("dedup"))
    store.create_schema()
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.drop_schema()
    store.close()


def test_a_handler_run_again_after_forget_sends_its_message_again(
    outbox: idemq.Outbox, tmp_path: Path
) -> None:
    queue, url = unique("q"), f"embedded://{tmp_path / 'queue.db'}"
    guard = idemq.Idempotency(outbox.store, consumer="pay")
    made: list[str] = []

    def pay(tx: sa.Connection) -> str:
        made.append(outbox.add(tx, queue, b"ship o1", ordering_key="o1"))
        return made[-1]

    message = "PAY_20240115143000123_NODE01_0001"
    assert guard.process(message, pay).status is idemq.Status.PROCESSED
    guard.forget(message)  # the operator wants the effect again (the row is still waiting)
    assert guard.process(message, pay).status is idemq.Status.PROCESSED
    assert guard.process(message, pay).status is idemq.Status.DUPLICATE
    assert len(made) == 2
    assert made[0] != made[1]  # a new message, which the next consumer runs again
    assert sorted(rows(outbox)) == sorted(made)
    relay = idemq.OutboxRelay(outbox, url)
    try:
        while outbox_stats(outbox).pending:
            relay.run_once()
    finally:
        relay.close()
    guard.forget(message)  # and once more, after the relay sent and deleted both rows
    assert guard.process(message, pay).status is idemq.Status.PROCESSED
    assert rows(outbox) == [made[2]]
    relay = idemq.OutboxRelay(outbox, url)
    try:
        while outbox_stats(outbox).pending:
            relay.run_once()
    finally:
        relay.close()
    reader = open_broker(url)
    try:
        # Three runs, three messages out. The third takes the first free id again (the first
        # run's, its row gone): the next consumer's guard decides, as for any resend.
        assert [g[0] for g in drain(reader, queue)] == made
    finally:
        reader.close()
    assert made[2] == made[0]


@pytest.mark.parametrize("url", [PG_URL, MYSQL_URL], ids=["postgres", "mysql"])
def test_concurrent_adds_under_one_callers_id_make_one_row_and_no_error(url: str) -> None:
    require_service("postgres" if url == PG_URL else "mysql")
    store = idemq.SqlStore(url)
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    start = threading.Barrier(8)
    answers: list[object] = []

    def add() -> None:
        try:
            with box.engine.begin() as conn:
                start.wait(10)
                answers.append(box.add(conn, "shipments", b"once", message_id="ONE-ID"))
        except Exception as exc:  # every outcome is collected and asserted
            answers.append(exc)

    threads = [threading.Thread(target=add) for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert answers == ["ONE-ID"] * 8
        assert rows(box) == ["ONE-ID"]
    finally:
        box.drop_schema()
        store.close()


def test_derived_ids_of_different_parts_never_collide() -> None:
    # Joined with a separator, these were one string; length-prefixed, they are not.
    pairs = [
        (("a\x1fb", "c", 0), ("a", "b\x1fc", 0)),
        (("a", "b\x1f0", 1), ("a", "b", "0\x1f1")),
        (("", "ab", 0), ("a", "b", 0)),
    ]
    for left, right in pairs:
        assert derived_id(*left) != derived_id(*right)
    assert derived_id("pay", "M1", 0) == derived_id("pay", "M1", 0)
    assert derived_id("pay", "M1", 0) != derived_id("pay", "M1", 0, generation=1)
    longest = derived_id("c" * 300, "m" * 128, "output-" + "9" * 50, generation=10**9)
    assert len(longest) <= 128


def test_handlers_whose_joined_parts_collide_add_two_messages(
    outbox: idemq.Outbox, tmp_path: Path
) -> None:
    seen: list[str] = []
    for consumer, message in (("a\x1fb", "c"), ("a", "b\x1fc")):
        guard = idemq.Idempotency(outbox.store, consumer=consumer)

        def handler(tx: sa.Connection) -> None:
            seen.append(outbox.add(tx, "shipments", b"x"))

        assert guard.process(message, handler).status is idemq.Status.PROCESSED
    assert len(set(seen)) == 2
    assert sorted(rows(outbox)) == sorted(seen)


@pytest.mark.parametrize("url", [PG_URL, MYSQL_URL], ids=["postgres", "mysql"])
def test_concurrent_async_adds_under_one_callers_id_make_one_row_and_no_error(url: str) -> None:
    require_service("postgres" if url == PG_URL else "mysql")
    name = unique("ob")
    store = idemq.AsyncSqlStore(url)
    box = idemq.AsyncOutbox(store, table=name)

    async def scenario() -> list[object]:
        await box.create_schema()
        start = asyncio.Barrier(8)

        async def add() -> object:
            try:
                async with store.engine.begin() as conn:
                    await start.wait()
                    return await box.add(conn, "shipments", b"once", message_id="ONE-ID")
            except Exception as exc:  # every outcome is collected and asserted
                return exc

        try:
            return list(await asyncio.gather(*(add() for _ in range(8))))
        finally:
            await store.engine.dispose()

    answers = asyncio.run(scenario())
    sync_store = idemq.SqlStore(url)
    sync_box = idemq.Outbox(sync_store, table=name)
    try:
        assert answers == ["ONE-ID"] * 8
        assert rows(sync_box) == ["ONE-ID"]
    finally:
        sync_box.drop_schema()
        sync_store.close()


def test_a_dead_row_whose_id_a_later_run_took_again_is_not_moved_back(
    outbox: idemq.Outbox, tmp_path: Path
) -> None:
    guard = idemq.Idempotency(outbox.store, consumer="pay")
    bad = unique("bad")
    made: list[str] = []

    def pay(tx: sa.Connection) -> None:
        made.append(outbox.add(tx, bad, b"ship o1"))

    message = "PAY_20240115143000123_NODE01_0002"
    assert guard.process(message, pay).status is idemq.Status.PROCESSED
    broker = open_broker(f"embedded://{tmp_path / 'queue.db'}")
    relay = idemq.OutboxRelay(outbox, RefusingBroker(broker, bad), max_attempts=1)  # type: ignore[arg-type]
    try:
        assert relay.run_once().dead == made
    finally:
        relay.close()
        broker.close()
    guard.forget(message)
    assert guard.process(message, pay).status is idemq.Status.PROCESSED
    assert made[1] == made[0]  # dead is not waiting: the first id was free
    with pytest.raises(idemq.InvalidInputError, match="also waiting"):
        retry_dead(outbox, made[0])
    stats = outbox_stats(outbox)
    assert (stats.pending, stats.dead) == (1, 1)  # the dead row kept, not dropped unsent
