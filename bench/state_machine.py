"""``StateMachine.apply`` and ``versioned_update`` vs the same statements on the bare driver.

Per backend (PostgreSQL, MariaDB, SQLite), one transaction per message, N orders:

* ``pay``      — the transition applies: one conditional UPDATE;
* ``pay again``— already PAID: the UPDATE matches nothing, a locking SELECT says why;
* ``cas``      — ``versioned_update`` of a balance at the version just read: one UPDATE.

The raw loop runs the same statements through the DBAPI cursor (psycopg 3, PyMySQL, sqlite3);
idemq gets one SQLAlchemy ``Connection`` with a transaction per message, as a handler's
``tx``. Best of ``--repeat``, contenders alternated. Prints msg/s and idemq / raw.

    python bench/state_machine.py [--n 2000] [--sqlite-n 20000] [--repeat 3] [--only sqlite,...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

import idemq

STATES = ["PENDING_PAYMENT", "PAYMENT_FAILED", "PAID", "SHIPPED"]
ORDERS = "bench_sm_orders"
ACCOUNTS = "bench_sm_accounts"
URLS = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}


def setup(engine: sa.Engine, n: int) -> None:
    with engine.begin() as c:
        c.exec_driver_sql(f"DROP TABLE IF EXISTS {ORDERS}")
        c.exec_driver_sql(f"DROP TABLE IF EXISTS {ACCOUNTS}")
        c.exec_driver_sql(
            f"CREATE TABLE {ORDERS} (order_id VARCHAR(64) PRIMARY KEY, status VARCHAR(32), "
            "paid_by VARCHAR(128), fence_token BIGINT)"
        )
        c.exec_driver_sql(
            f"CREATE TABLE {ACCOUNTS} (account_id VARCHAR(64) PRIMARY KEY, balance BIGINT, "
            "version INTEGER, fence_token BIGINT)"
        )
        c.execute(
            sa.text(f"INSERT INTO {ORDERS} (order_id, status) VALUES (:k, 'PENDING_PAYMENT')"),
            [{"k": f"o{i}"} for i in range(n)],
        )
        c.execute(
            sa.text(f"INSERT INTO {ACCOUNTS} VALUES (:k, 0, 0, NULL)"),
            [{"k": f"a{i}"} for i in range(n)],
        )


def raw_loops(engine: sa.Engine, n: int) -> dict[str, Callable[[], float]]:
    """The statements ``apply``/``versioned_update`` run, on the DBAPI cursor."""
    mark = "?" if engine.dialect.paramstyle == "qmark" else "%s"
    lock = "" if engine.dialect.name == "sqlite" else " FOR UPDATE"
    pay = (
        f"UPDATE {ORDERS} SET status = {mark}, paid_by = {mark} WHERE order_id = {mark} "
        f"AND status IN ({mark}, {mark})"
    )
    probe = f"SELECT status FROM {ORDERS} WHERE order_id = {mark}{lock}"
    cas = (
        f"UPDATE {ACCOUNTS} SET balance = {mark}, version = version + 1 "
        f"WHERE account_id = {mark} AND version = {mark}"
    )

    def loop(body: Callable[[Any, int], None]) -> Callable[[], float]:
        def run() -> float:
            conn = engine.raw_connection()
            cur = conn.cursor()
            begin = engine.dialect.name == "sqlite"
            started = time.perf_counter()
            for i in range(n):
                if begin:
                    cur.execute("BEGIN IMMEDIATE")
                body(cur, i)
                conn.commit()
            elapsed = time.perf_counter() - started
            conn.close()
            return elapsed

        return run

    def pay_once(cur: Any, i: int) -> None:
        cur.execute(pay, ("PAID", f"m{i}", f"o{i}", "PENDING_PAYMENT", "PAYMENT_FAILED"))
        if cur.rowcount != 1:
            cur.execute(probe, (f"o{i}",))
            cur.fetchall()

    def cas_once(cur: Any, i: int) -> None:
        cur.execute(cas, (i, f"a{i}", 0))

    return {"pay": loop(pay_once), "pay again": loop(pay_once), "cas": loop(cas_once)}


def idemq_loops(engine: sa.Engine, n: int) -> dict[str, Callable[[], float]]:
    machine = idemq.StateMachine(
        ORDERS,
        "order_id",
        "status",
        states=STATES,
        transitions={"pay": (("PENDING_PAYMENT", "PAYMENT_FAILED"), "PAID")},
    )

    def loop(body: Callable[[sa.Connection, int], object]) -> Callable[[], float]:
        def run() -> float:
            # One connection, a transaction per message: what a handler's ``tx`` is.
            with engine.connect() as tx:
                started = time.perf_counter()
                for i in range(n):
                    with tx.begin():
                        body(tx, i)
                return time.perf_counter() - started

        return run

    def pay(tx: sa.Connection, i: int) -> object:
        return machine.apply(tx, f"o{i}", "pay", {"paid_by": f"m{i}"})

    def cas(tx: sa.Connection, i: int) -> object:
        return idemq.versioned_update(tx, ACCOUNTS, "account_id", f"a{i}", 0, {"balance": i})

    return {"pay": loop(pay), "pay again": loop(pay), "cas": loop(cas)}


def bench(engine: sa.Engine, n: int, repeat: int) -> dict[str, tuple[float, float]]:
    best: dict[tuple[str, str], float] = {}
    for rep in range(repeat):
        order = ("raw", "idemq") if rep % 2 == 0 else ("idemq", "raw")
        for contender in order:
            setup(engine, n)
            loops = raw_loops(engine, n) if contender == "raw" else idemq_loops(engine, n)
            for phase, run in loops.items():
                elapsed = run()
                best[contender, phase] = min(best.get((contender, phase), float("inf")), elapsed)
    return {
        phase: (n / best["raw", phase], n / best["idemq", phase])
        for phase in ("pay", "pay again", "cas")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="messages per pass (PG, MariaDB)")
    parser.add_argument("--sqlite-n", type=int, default=20000, help="messages per pass (SQLite)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="postgres,mariadb,sqlite")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'backend':<10}{'pass':<12}{'raw msg/s':>12}{'idemq msg/s':>14}{'ratio':>8}")
    for name in args.only.split(","):
        # idemq's engine settings (SQLite: WAL, BEGIN IMMEDIATE from the begin event).
        store = idemq.SqlStore(URLS.get(name) or f"sqlite:///{tempfile.mkdtemp()}/sm.db")
        engine, n = store.engine, args.sqlite_n if name == "sqlite" else args.n
        for phase, (raw, ours) in bench(engine, n, args.repeat).items():
            print(f"{name:<10}{phase:<12}{raw:>12,.0f}{ours:>14,.0f}{ours / raw:>7.2f}x")
        store.close()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
