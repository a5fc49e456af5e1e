"""The relay on the real brokers: every broker once, a SIGKILL between publish and mark, three
relays side by side, a 10 s broker outage (PostgreSQL outbox; order and counts asserted)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import Broker, Delivery
from idemq.outbox import outbox_stats
from tests.conftest import PG_URL, REDIS_URL, require_service, unique
from tests.contract._proxy import CuttableProxy
from tests.integration.brokers.test_kafka import tansu  # noqa: F401 - the Kafka fixture

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture
def outbox() -> Iterator[idemq.Outbox]:
    require_service("postgres")
    store = idemq.SqlStore(PG_URL)
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


def receive(broker: Broker, queue: str, count: int, timeout_s: float = 60) -> list[Delivery]:
    """``count`` deliveries of ``queue`` (acked), or fewer when ``timeout_s`` runs out."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    stream = broker.consume(queue, prefetch=100)
    try:
        while len(got) < count and time.monotonic() < deadline:
            delivery = next(stream)
            if delivery is not None:
                got.append(delivery)
                delivery.ack()
    finally:
        stream.close()
    return got


def relay_until_empty(relay: idemq.OutboxRelay, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while outbox_stats(relay.outbox).pending and time.monotonic() < deadline:
        relay.run_once()


@pytest.fixture(params=["amqp", "kafka", "nats", "redis", "mqtt", "embedded"])
def broker_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind: str = request.param
    if kind == "embedded":
        return f"embedded://{tmp_path / 'queue.db'}"
    if kind == "kafka":
        bootstrap: str = request.getfixturevalue("tansu")
        return f"kafka://{bootstrap}?session_timeout_ms=2000"
    service = {"amqp": "rabbitmq", "nats": "nats", "redis": "redis", "mqtt": "mqtt"}[kind]
    require_service(service)
    return {
        "amqp": AMQP_URL,
        "nats": "nats://127.0.0.1:4222",
        "redis": REDIS_URL,
        "mqtt": "mqtt://127.0.0.1:1883",
    }[kind]


def test_every_broker_through_the_relay(outbox: idemq.Outbox, broker_url: str) -> None:
    queue = unique("q")
    consumer = open_broker(broker_url)
    try:
        consumer.declare(queue)
        stream = consumer.consume(queue, prefetch=10)
        next(stream)  # subscribed before anything is published (MQTT keeps nothing otherwise)
        with outbox.engine.begin() as conn:
            made = [
                outbox.add(conn, queue, b"m%d" % i, headers={"n": str(i)}, ordering_key="o1")
                for i in range(3)
            ]
        relay = idemq.OutboxRelay(outbox, broker_url)
        try:
            relay_until_empty(relay)
        finally:
            relay.close()
        got: list[Delivery] = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            delivery = next(stream)
            if delivery is not None:
                got.append(delivery)
                delivery.ack()
        stream.close()
        assert [d.message.id for d in got if d.message] == made
        assert [d.body for d in got] == [b"m0", b"m1", b"m2"]
        consumer.delete_queue(queue)
    finally:
        consumer.close()


def _ship_tables(engine: sa.Engine, name: str) -> sa.Table:
    meta = sa.MetaData()
    shipments = sa.Table(
        name,
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(32), nullable=False),
    )
    meta.create_all(engine)
    return shipments


class KillAfterPublish:
    """The real broker; the process SIGKILLs itself right after the first confirm."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner

    def publish(self, queue: str, body: bytes, **kw: Any) -> None:
        self.inner.publish(queue, body, **kw)
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self.inner.close()


def _dying_relay(table: str) -> None:
    store = idemq.SqlStore(PG_URL)
    box = idemq.Outbox(store, table=table)
    idemq.OutboxRelay(box, KillAfterPublish(open_broker(AMQP_URL))).run_once()  # type: ignore[arg-type]


def test_relay_killed_between_publish_and_mark_republishes_the_same_id(
    outbox: idemq.Outbox,
) -> None:
    require_service("rabbitmq")
    queue = unique("ship")
    broker = open_broker(AMQP_URL)
    shipments = _ship_tables(outbox.engine, unique("shipments"))
    dedup = idemq.SqlStore(outbox.engine, table=unique("dedup"))
    dedup.create_schema()
    try:
        broker.declare(queue)
        with outbox.engine.begin() as conn:
            sent = outbox.add(conn, queue, b'{"order_id": "o1"}')
        child = multiprocessing.get_context("fork").Process(
            target=_dying_relay, args=(outbox.table,)
        )
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        assert outbox_stats(outbox).pending == 1  # published, never marked
        relay = idemq.OutboxRelay(outbox, AMQP_URL)
        try:
            relay_until_empty(relay)
        finally:
            relay.close()
        got = receive(broker, queue, 2, timeout_s=30)
        assert [d.message.id for d in got if d.message] == [sent, sent]

        guard = idemq.Idempotency(dedup, consumer="ship")

        def ship(tx: sa.Connection, body: bytes) -> None:
            tx.execute(shipments.insert().values(order_id=json.loads(body)["order_id"]))

        statuses = [
            guard.process(d.message.id, lambda tx, d=d: ship(tx, d.body)).status  # type: ignore[misc,union-attr]
            for d in got
        ]
        assert statuses == [idemq.Status.PROCESSED, idemq.Status.DUPLICATE]
        with outbox.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(shipments)).scalar() == 1
        broker.delete_queue(queue)
    finally:
        broker.close()
        dedup.drop_schema()
        shipments.drop(outbox.engine)


def _run_relays(
    box: idemq.Outbox, url: str, count: int
) -> tuple[threading.Event, list[threading.Thread], list[idemq.OutboxRelay]]:
    stop = threading.Event()
    relays = [idemq.OutboxRelay(box, url, batch_size=100, poll_s=0.2) for _ in range(count)]
    threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in relays]
    for thread in threads:
        thread.start()
    return stop, threads, relays


def _stop(
    stop: threading.Event, threads: list[threading.Thread], relays: list[idemq.OutboxRelay]
) -> None:
    stop.set()
    for thread in threads:
        thread.join(30)
    for relay in relays:
        relay.close()


def test_three_relays_5000_rows_each_once_in_order_per_key(outbox: idemq.Outbox) -> None:
    require_service("rabbitmq")
    queue = unique("q")
    broker = open_broker(AMQP_URL)
    broker.declare(queue)
    keys, total, writers = 60, 5000, 3
    stop, threads, relays = _run_relays(outbox, AMQP_URL, 3)

    def write(writer: int) -> None:
        # Each key belongs to one writer, which adds its rows in order, 10 per transaction.
        mine = [
            (k, n) for n in range(total // keys + 1) for k in range(keys) if k % writers == writer
        ]
        mine = [(k, n) for k, n in mine if n * keys + k < total]
        for start in range(0, len(mine), 10):
            with outbox.engine.begin() as conn:
                for k, n in mine[start : start + 10]:
                    body = json.dumps({"k": k, "n": n}).encode()
                    outbox.add(conn, queue, body, ordering_key=f"key{k}")

    try:
        writer_threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for thread in writer_threads:
            thread.start()
        for thread in writer_threads:
            thread.join()
        got = receive(broker, queue, total, timeout_s=180)
        time.sleep(1)
        got += receive(broker, queue, 1, timeout_s=1)  # nothing more: no row twice
    finally:
        _stop(stop, threads, relays)
    seen = [json.loads(d.body) for d in got]
    assert len(seen) == total
    assert len({d.message.id for d in got if d.message}) == total
    per_key: dict[int, list[int]] = {}
    for item in seen:
        per_key.setdefault(item["k"], []).append(item["n"])
    for key, ns in per_key.items():
        assert ns == sorted(ns), f"key{key} out of order"
        assert ns == list(range(len(ns)))
    assert sum(r.published_total for r in relays) == total
    assert all(r.published_total > 0 for r in relays)
    broker.delete_queue(queue)
    broker.close()


def test_broker_down_for_10s_rows_wait_then_all_arrive(outbox: idemq.Outbox) -> None:
    require_service("rabbitmq")
    queue = unique("q")
    proxy = CuttableProxy(("127.0.0.1", 5672))
    consumer = open_broker(AMQP_URL)
    consumer.declare(queue)
    stop, threads, relays = _run_relays(outbox, f"amqp://guest:guest@127.0.0.1:{proxy.port}/", 1)

    def add(count: int, start: int) -> list[str]:
        with outbox.engine.begin() as conn:
            return [outbox.add(conn, queue, b"%d" % (start + i)) for i in range(count)]

    try:
        made = add(20, 0)
        deadline = time.monotonic() + 30
        while outbox_stats(outbox).pending and time.monotonic() < deadline:
            time.sleep(0.1)
        proxy.cut()
        made += add(30, 20)
        time.sleep(10)
        stats = outbox_stats(outbox)
        assert stats.pending == 30
        assert stats.dead == 0
        proxy.restore()
        got = receive(consumer, queue, 50, timeout_s=90)
    finally:
        _stop(stop, threads, relays)
        proxy.close()
    assert sorted({d.message.id for d in got if d.message}) == sorted(made)
    assert outbox_stats(outbox).dead == 0
    consumer.delete_queue(queue)
    consumer.close()


def test_an_idle_postgresql_relay_wakes_on_notify_not_on_its_poll(
    outbox: idemq.Outbox, tmp_path: Path
) -> None:
    url = f"embedded://{tmp_path / 'queue.db'}"
    stop = threading.Event()
    relay = idemq.OutboxRelay(outbox, url, poll_s=30)
    thread = threading.Thread(target=relay.run, args=(stop,))
    thread.start()
    try:
        time.sleep(1)  # idle: listening, its next poll 30 s away
        with outbox.engine.begin() as conn:
            outbox.add(conn, "woken", b"x")
        started = time.monotonic()
        while outbox_stats(outbox).pending and time.monotonic() - started < 20:
            time.sleep(0.02)
        assert time.monotonic() - started < 5, "published on the NOTIFY, long before the poll"
    finally:
        stop.set()
        with outbox.engine.begin() as conn:
            outbox.add(conn, "woken", b"wake up to stop")  # so the 30 s wait ends now
        thread.join(60)
        relay.close()
