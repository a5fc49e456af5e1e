"""idemq's outbox vs a hand-written relay loop and vs faststream-outbox, PostgreSQL → RabbitMQ,
in one run, turns interleaved (each contender once per round, best round reported).

Relay: ``--rows`` committed rows are relayed to one RabbitMQ queue, each publish waiting for the
broker's confirm, each row deleted after its confirm; the time is from start until the table is
empty.

* idemq: ``OutboxRelay.run_once`` until empty (batch 100);
* hand: the loop a careful engineer writes on the same engine and the same broker connection —
  ``SELECT … ORDER BY seq LIMIT 100 FOR UPDATE SKIP LOCKED``, publish each with confirm,
  ``DELETE … WHERE id = ANY(…)``, COMMIT (no ordering keys, no backoff, no dead letters);
* faststream-outbox 0.19.0: its ``OutboxBroker`` subscriber (``fetch_batch_size=100``,
  ``max_workers=1``) stacked under a FastStream ``RabbitBroker`` publisher (confirms on);
* bound: the same number of confirmed publishes on idemq's broker connection, no database.

Add: transactions of one ``Outbox.add`` each vs the same INSERT written by hand
(``conn.execute(text(INSERT …))`` with a uuid id) on the same engine, in alternating chunks of
100 (``--adds`` per contender per round); the median chunk is reported.

    python bench/outbox.py [--rows 3000] [--adds 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

import idemq
from idemq.brokers import open_broker
from idemq.brokers.base import Broker

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_ASYNCPG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
QUEUE = f"bench_outbox_{uuid.uuid4().hex[:8]}"
ADD_CHUNK = 100
BODY = json.dumps({"order_id": "order_123", "amount": 4200}).encode()


def fill(box: idemq.Outbox, rows: int) -> None:
    with box.engine.begin() as conn:
        for _ in range(rows):
            box.add(conn, QUEUE, BODY)


def pending(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


def idemq_relay(box: idemq.Outbox, broker: Broker) -> float:
    relay = idemq.OutboxRelay(box, broker, batch_size=100)
    start = time.perf_counter()
    while relay.run_once().claimed:
        pass
    elapsed = time.perf_counter() - start
    relay.close()
    return elapsed


def hand_relay(box: idemq.Outbox, broker: Broker) -> float:
    claim = sa.text(
        f"SELECT id, destination, body FROM {box.table} ORDER BY seq LIMIT 100"
        " FOR UPDATE SKIP LOCKED"
    )
    delete = sa.text(f"DELETE FROM {box.table} WHERE id = ANY(:ids)")
    start = time.perf_counter()
    with box.engine.connect() as conn:
        while True:
            with conn.begin():
                rows = conn.execute(claim).all()
                if not rows:
                    break
                for row in rows:
                    broker.publish(row.destination, bytes(row.body), message_id=row.id)
                conn.execute(delete, {"ids": [row.id for row in rows]})
    return time.perf_counter() - start


def bare_publish(broker: Broker, rows: int) -> float:
    start = time.perf_counter()
    for i in range(rows):
        broker.publish(QUEUE, BODY, message_id=f"BARE-{i}")
    return time.perf_counter() - start


class FaststreamOutbox:
    """faststream-outbox 0.19.0 relaying its own table to RabbitMQ."""

    def __init__(self) -> None:
        from faststream_outbox import make_outbox_table  # noqa: PLC0415

        self.metadata = sa.MetaData()
        self.table = make_outbox_table(
            self.metadata, table_name=f"bench_fso_{uuid.uuid4().hex[:8]}"
        )
        self.sync_engine = sa.create_engine(PG_URL)
        self.metadata.create_all(self.sync_engine)

    async def fill(self, rows: int) -> None:
        from faststream_outbox import OutboxBroker  # noqa: PLC0415
        from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine  # noqa: PLC0415

        engine = create_async_engine(PG_ASYNCPG_URL)
        broker = OutboxBroker(engine, outbox_table=self.table, logger=None)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        async with sessions() as session, session.begin():
            for _ in range(rows):
                await broker.publish(BODY, queue="fso_relay", session=session)
        await engine.dispose()

    async def relay(self, rows: int) -> float:
        from faststream.rabbit import RabbitBroker  # noqa: PLC0415
        from faststream_outbox import OutboxBroker  # noqa: PLC0415
        from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415

        engine = create_async_engine(PG_ASYNCPG_URL)
        outbox_broker = OutboxBroker(engine, outbox_table=self.table, logger=None)
        rabbit = RabbitBroker(AMQP_URL, logger=None)
        publisher = rabbit.publisher(QUEUE)

        @publisher
        @outbox_broker.subscriber("fso_relay", fetch_batch_size=100, max_workers=1)
        async def relay(body: dict[str, Any]) -> dict[str, Any]:
            return body

        await rabbit.connect()
        start = time.perf_counter()
        await outbox_broker.start()
        while pending(self.sync_engine, self.table.name):
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - start
        await outbox_broker.stop()
        await rabbit.stop()
        await engine.dispose()
        return elapsed

    def drop(self) -> None:
        self.metadata.drop_all(self.sync_engine)
        self.sync_engine.dispose()


def add_turn(box: idemq.Outbox, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        with box.engine.begin() as conn:
            box.add(conn, QUEUE, BODY, headers={"k": "v"})
    return time.perf_counter() - start


def _hand_insert(box: idemq.Outbox, count: int, *, notify: bool) -> float:
    columns = "id, destination, body, headers, ordering_key, created_ms, attempts, next_attempt_ms"
    values = ":id, :destination, :body, :headers, NULL, :now, 0, :now"
    if notify:  # the bound: idemq's statement (INSERT + NOTIFY in one), written by hand
        sql = f"INSERT INTO {box.table} ({columns}) SELECT {values}"
        sql += " FROM (SELECT pg_notify(:channel, '')) AS n"
    else:
        sql = f"INSERT INTO {box.table} ({columns}) VALUES ({values})"
    insert = sa.text(sql)
    start = time.perf_counter()
    for _ in range(count):
        with box.engine.begin() as conn:
            now = int(time.time() * 1000)
            params = {
                "id": str(uuid.uuid4()),
                "destination": QUEUE,
                "body": BODY,
                "headers": json.dumps({"k": "v"}),
                "now": now,
                "channel": box.table,
            }
            if not notify:
                del params["channel"]
            conn.execute(insert, params)
    return time.perf_counter() - start


def hand_insert_turn(box: idemq.Outbox, count: int) -> float:
    return _hand_insert(box, count, notify=False)


def hand_notify_turn(box: idemq.Outbox, count: int) -> float:
    return _hand_insert(box, count, notify=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--adds", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-faststream", action="store_true")
    args = parser.parse_args()

    store = idemq.SqlStore(PG_URL)
    box = idemq.Outbox(store, table=f"bench_outbox_{uuid.uuid4().hex[:8]}")
    box.create_schema()
    broker = open_broker(AMQP_URL)
    broker.declare(QUEUE)
    fso = None if args.no_faststream else FaststreamOutbox()
    times: dict[str, list[float]] = {
        k: [] for k in ("idemq", "hand", "fso", "bare", "add", "ins", "insn")
    }
    try:
        for round_no in range(args.rounds):
            turns: list[tuple[str, Callable[[], float]]] = [
                ("idemq", lambda: idemq_relay(box, broker)),
                ("hand", lambda: hand_relay(box, broker)),
                ("bare", lambda: bare_publish(broker, args.rows)),
            ]
            if fso is not None:
                turns.append(("fso", lambda: asyncio.run(fso.relay(args.rows))))
            if round_no % 2:
                turns.reverse()
            for name, turn in turns:
                if name in ("idemq", "hand"):
                    fill(box, args.rows)
                elif name == "fso":
                    assert fso is not None
                    asyncio.run(fso.fill(args.rows))
                times[name].append(turn())
                print(f"round {round_no} {name:6s} {args.rows / times[name][-1]:8.0f} rows/s")
        # add vs INSERT: short alternating chunks, so the machine's drift hits both alike.
        for chunk in range(max(1, args.adds // ADD_CHUNK) * args.rounds):
            pair: list[tuple[str, Callable[[idemq.Outbox, int], float]]] = [
                ("add", add_turn),
                ("ins", hand_insert_turn),
                ("insn", hand_notify_turn),
            ]
            for name, run in pair if chunk % 2 == 0 else pair[::-1]:
                times[name].append(run(box, ADD_CHUNK))
            if chunk % 10 == 9:
                with box.engine.begin() as conn:
                    conn.execute(sa.text(f"DELETE FROM {box.table}"))
    finally:
        broker.delete_queue(QUEUE)
        broker.close()
        box.drop_schema()
        store.close()
        if fso is not None:
            fso.drop()
    report(times, args.rows)


def report(times: dict[str, list[float]], rows: int) -> None:
    rate = {k: rows / min(times[k]) for k in ("idemq", "hand", "fso", "bare") if times[k]}
    for k in ("add", "ins", "insn"):
        rate[k] = ADD_CHUNK / statistics.median(times[k])
    print()
    line = f"relay  idemq {rate['idemq']:.0f} rows/s, hand-written {rate['hand']:.0f} rows/s"
    line += f", bare publishes {rate['bare']:.0f}/s"
    if "fso" in rate:
        line += f", faststream-outbox {rate['fso']:.0f} rows/s"
    print(line)
    print(f"ratio  idemq / hand-written = {rate['idemq'] / rate['hand']:.2f}  (target >= 0.8)")
    if "fso" in rate:
        print(
            f"ratio  idemq / faststream-outbox = {rate['idemq'] / rate['fso']:.2f}  (target >= 1.5)"
        )
    print(f"ratio  hand-written / bare publishes = {rate['hand'] / rate['bare']:.2f}  (bound)")
    print(f"add    idemq {rate['add']:.0f} tx/s, hand INSERT {rate['ins']:.0f} tx/s (median chunk)")
    print(f"ratio  add / hand INSERT = {rate['add'] / rate['ins']:.2f}  (target >= 0.9)")
    print(
        f"bound  hand INSERT+NOTIFY {rate['insn']:.0f} tx/s: NOTIFY costs"
        f" {rate['insn'] / rate['ins']:.2f}x; add / hand INSERT+NOTIFY ="
        f" {rate['add'] / rate['insn']:.2f}"
    )


if __name__ == "__main__":
    main()
