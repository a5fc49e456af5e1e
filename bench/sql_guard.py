"""idemq's transactional guard vs a hand-written raw-driver loop, same run, same database.

The raw loop is the seed's SQL with the bare driver (psycopg 3, PyMySQL, sqlite3): insert the dedup
row and, if it was new, the business UPDATE, in one transaction. idemq runs the same business
UPDATE through ``tx.exec_driver_sql`` inside ``Idempotency.process``. Two passes each: first
delivery of N ids, then all N again (duplicates). Best of ``--repeat`` runs, contenders alternated.
A third loop prints the *bound*: the raw loop with idemq's own claim statement in place of the
raw INSERT (see :func:`claim_loop`). A fourth is the raw loop written on SQLAlchemy instead of
the bare driver (:func:`sqlalchemy_loop`): ``engine.begin()`` and ``exec_driver_sql``, what a
hand-written consumer whose handler takes a SQLAlchemy ``Connection``, as idemq's does, pays.
Each row also prints the client CPU per message (``time.process_time``: this process only, the
servers excluded), and every ratio.

    python bench/sql_guard.py [--n 2000] [--sqlite-n 20000] [--repeat 3] [--only postgres,...]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pymysql
import sqlalchemy as sa

import idemq
from idemq.drivers.sql import DriverStatement, Step
from idemq.guard.core import Policy
from idemq.stores.sql.dialects import plans_for

PG_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
RAW_TABLE = "bench_message_idempotent_raw"
SA_TABLE = "bench_message_idempotent_sa"
IDEMQ_TABLE = "bench_message_idempotent"
ACCOUNTS = "bench_accounts"


@dataclass
class Backend:
    name: str
    url: str
    param: str  # the driver's placeholder for the business UPDATE
    raw_connect: Callable[[], Any]
    raw_insert: str
    n: int


def seed_ddl(backend: Backend) -> list[str]:
    ts = "TIMESTAMP" if backend.name == "postgres" else "DATETIME"
    return [
        f"DROP TABLE IF EXISTS {RAW_TABLE}",
        f"DROP TABLE IF EXISTS {SA_TABLE}",
        f"DROP TABLE IF EXISTS {ACCOUNTS}",
        *(
            f"CREATE TABLE {table} (message_id VARCHAR(128) PRIMARY KEY, business_id VARCHAR(64), "
            f"status SMALLINT DEFAULT 0, processed_time {ts}, "
            f"created_time {ts} DEFAULT CURRENT_TIMESTAMP)"
            for table in (RAW_TABLE, SA_TABLE)
        ),
        f"CREATE TABLE {ACCOUNTS} (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL)",
        f"INSERT INTO {ACCOUNTS} (id, balance) VALUES (1, 1000000000)",
    ]


def setup(backend: Backend) -> idemq.SqlStore:
    store = idemq.SqlStore(backend.url, table=IDEMQ_TABLE)
    store.drop_schema()
    store.create_schema()
    with store.engine.begin() as conn:
        for statement in seed_ddl(backend):
            conn.exec_driver_sql(statement)
    return store


def reset(store: idemq.SqlStore) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {RAW_TABLE}")
        conn.exec_driver_sql(f"DELETE FROM {SA_TABLE}")
        conn.exec_driver_sql(f"DELETE FROM {IDEMQ_TABLE}")


class Clocks:
    """Wall time and this process's CPU time, started together."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def raw_loop(backend: Backend, ids: list[str]) -> tuple[float, float]:
    conn = backend.raw_connect()
    cur = conn.cursor()
    update = f"UPDATE {ACCOUNTS} SET balance = balance - 1 WHERE id = {backend.param}"
    clocks = Clocks()
    for message_id in ids:
        if backend.name == "sqlite":
            cur.execute("BEGIN IMMEDIATE")
        cur.execute(backend.raw_insert, (message_id, message_id[:64]))
        if cur.rowcount == 1:
            cur.execute(update, (1,))
        conn.commit()
    elapsed = clocks.stop()
    conn.close()
    return elapsed


def claim_loop(store: idemq.SqlStore, backend: Backend, ids: list[str]) -> tuple[float, float]:
    """The raw loop with idemq's own claim in place of the raw INSERT: a bound, not a contender.

    The claim inserts the record and, when it loses, hands back the stored one (a duplicate is
    answered with its result); the raw INSERT reads nothing back. Statements and parameters are
    rendered before the clock starts, so no idemq or SQLAlchemy code runs per message: what this
    loop loses against the raw one, no guard that replays a stored result can win back.
    The SQL and parameters are the store's own: its plans' compiled statements
    (:class:`~idemq.drivers.sql.DriverStatement`), bound as the store binds them.
    """
    with store.engine.connect() as probe:  # MariaDB vs MySQL is known once connected
        plans = plans_for(probe.dialect, store.table)

    def render(step: Step) -> tuple[str, Any]:
        assert isinstance(step.statement, DriverStatement)
        return step.statement.bind(step.params)

    policy = Policy.build(consumer="bench-claim", mode="transactional", lease_s=30, clock=None)
    requests = [policy.request(message_id, message_id[:64]) for message_id in ids]
    # The first step of each claim plan: the claim statement, with this message's parameters.
    claims = [render(next(plans.claim(request, True))) for request in requests]
    reads = [render(next(plans.get(request.key))) for request in requests]
    conn = backend.raw_connect()
    cur = conn.cursor()
    update = f"UPDATE {ACCOUNTS} SET balance = balance - 1 WHERE id = {backend.param}"
    clocks = Clocks()
    for request, claim, read in zip(requests, claims, reads, strict=True):
        if backend.name == "sqlite":  # won iff a row changed; a lost claim reads the record
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(*claim)
            won = cur.rowcount == 1
            if not won:
                cur.execute(*read).fetchall()
        else:  # one round trip: PostgreSQL (1, NULLs) or (0, record); MariaDB (owner, record)
            cur.execute(*claim)
            first = cur.fetchall()[0][0]
            won = first == 1 if backend.name == "postgres" else first == request.owner
        if won:
            cur.execute(update, (1,))
        conn.commit()
    elapsed = clocks.stop()
    conn.close()
    return elapsed


def sqlalchemy_loop(store: idemq.SqlStore, backend: Backend, ids: list[str]) -> tuple[float, float]:
    """The raw loop on SQLAlchemy: one ``engine.begin()`` per message (a pooled connection, its
    transaction, COMMIT), the raw INSERT (into a dedup table of its own) and the business UPDATE
    through ``exec_driver_sql``."""
    engine = store.engine
    insert = backend.raw_insert.replace(RAW_TABLE, SA_TABLE)
    placeholder = ":id" if backend.name == "sqlite" else "%(id)s"
    update = f"UPDATE {ACCOUNTS} SET balance = balance - 1 WHERE id = {placeholder}"
    params = {"id": 1}
    clocks = Clocks()
    for message_id in ids:
        with engine.begin() as conn:
            inserted = conn.exec_driver_sql(insert, (message_id, message_id[:64]))
            if inserted.rowcount == 1:
                conn.exec_driver_sql(update, params)
    return clocks.stop()


def idemq_loop(store: idemq.SqlStore, backend: Backend, ids: list[str]) -> tuple[float, float]:
    guard = idemq.Idempotency(store, consumer="bench")
    placeholder = ":id" if backend.name == "sqlite" else "%(id)s"
    update = f"UPDATE {ACCOUNTS} SET balance = balance - 1 WHERE id = {placeholder}"
    params = {"id": 1}

    def handler(tx: sa.Connection) -> None:
        tx.exec_driver_sql(update, params)

    clocks = Clocks()
    for message_id in ids:
        guard.process(message_id, handler, business_id=message_id[:64])
    return clocks.stop()


def bench(backend: Backend, repeat: int) -> list[tuple[str, dict[str, tuple[float, float]]]]:
    """Per pass and contender: (msg/s, client CPU µs per message), each the best of ``repeat``
    runs, contenders alternated."""
    store = setup(backend)
    ids = [f"ORDER_20240115143000{i % 1000:03d}_NODE01_{i:06d}" for i in range(backend.n)]
    loops: dict[str, Callable[[], tuple[float, float]]] = {
        "raw": lambda: raw_loop(backend, ids),
        "claim": lambda: claim_loop(store, backend, ids),
        "sqlalchemy": lambda: sqlalchemy_loop(store, backend, ids),
        "idemq": lambda: idemq_loop(store, backend, ids),
    }
    wall: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    for _ in range(repeat):
        reset(store)
        for contender, run in loops.items():
            for phase in ("first", "duplicates"):
                elapsed, used = run()
                key = (contender, phase)
                wall[key] = min(wall.get(key, float("inf")), elapsed)
                cpu[key] = min(cpu.get(key, float("inf")), used)
    store.close()
    return [
        (
            phase,
            {
                contender: (
                    backend.n / wall[contender, phase],
                    1e6 * cpu[contender, phase] / backend.n,
                )
                for contender in loops
            },
        )
        for phase in ("first", "duplicates")
    ]


def backends(args: argparse.Namespace) -> list[Backend]:
    sqlite_path = os.path.join(tempfile.mkdtemp(prefix="idemq-bench-"), "bench.db")

    def sqlite_connect() -> sqlite3.Connection:
        conn = sqlite3.connect(sqlite_path, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    every = [
        Backend(
            "postgres",
            PG_URL,
            "%s",
            lambda: psycopg.connect(PG_DSN),
            f"INSERT INTO {RAW_TABLE} (message_id, business_id, status, processed_time) "
            "VALUES (%s, %s, 1, now()) ON CONFLICT (message_id) DO NOTHING",
            args.n,
        ),
        Backend(
            "mariadb",
            MYSQL_URL,
            "%s",
            lambda: pymysql.connect(host="127.0.0.1", user="root", database="test"),
            f"INSERT IGNORE INTO {RAW_TABLE} (message_id, business_id, status, processed_time) "
            "VALUES (%s, %s, 1, NOW(6))",
            args.n,
        ),
        Backend(
            "sqlite",
            f"sqlite:///{sqlite_path}",
            "?",
            sqlite_connect,
            f"INSERT OR IGNORE INTO {RAW_TABLE} (message_id, business_id, status, processed_time) "
            "VALUES (?, ?, 1, CURRENT_TIMESTAMP)",
            args.sqlite_n,
        ),
    ]
    return [b for b in every if not args.only or b.name in args.only.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="messages per pass (PG, MariaDB)")
    parser.add_argument("--sqlite-n", type=int, default=20000, help="messages per pass (SQLite)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated: postgres,mariadb,sqlite")
    args = parser.parse_args()
    print(
        f"{'backend':<10}{'pass':<12}{'raw msg/s':>10}{'cpu us':>8}{'idemq msg/s':>12}{'cpu us':>8}"
        f"{'ratio':>7}{'bound msg/s':>12}{'cpu us':>8}{'bound':>7}{'idemq/bound':>12}"
        f"{'sa msg/s':>10}{'cpu us':>8}{'sa':>7}{'idemq/sa':>9}"
    )
    for backend in backends(args):
        for phase, rate in bench(backend, args.repeat):
            (raw, raw_cpu), (ours, our_cpu), (bound, bound_cpu), (by_sa, sa_cpu) = (
                rate["raw"],
                rate["idemq"],
                rate["claim"],
                rate["sqlalchemy"],
            )
            print(
                f"{backend.name:<10}{phase:<12}{raw:>10,.0f}{raw_cpu:>8.0f}{ours:>12,.0f}"
                f"{our_cpu:>8.0f}{ours / raw:>6.2f}x{bound:>12,.0f}{bound_cpu:>8.0f}"
                f"{bound / raw:>6.2f}x{ours / bound:>11.2f}x{by_sa:>10,.0f}{sa_cpu:>8.0f}"
                f"{by_sa / raw:>6.2f}x{ours / by_sa:>8.2f}x"
            )
    print(
        "cpu us: client CPU per message (this process); ratio: idemq / raw; bound: the raw loop "
        "running idemq's own claim (which returns the stored record, as a duplicate's replay "
        "needs), no idemq code per message, / raw; sa: the raw loop written on SQLAlchemy "
        "(engine.begin(), exec_driver_sql), / raw"
    )


if __name__ == "__main__":
    main()
