"""A dedup table of millions of rows: claim latency by table size, and while a purge runs.

Three tables per database (``bench_bt_0``, ``bench_bt_m`` with ``--mid`` rows, ``bench_bt_n``
with ``--rows``), filled in bulk (``generate_series`` / MariaDB's ``seq_1_to_N``, not through the
guard; processed times spread over the last ``--spread-s`` seconds) once and kept between runs
(``--refill`` makes them again; a run's purges delete rows, so a second run needs it). Then,
interleaved in rounds of ``--chunk`` messages per table:

* first deliveries and duplicates of old ids (random over the table) through the guard in
  transactional mode, p50/p99 per table size; the target is p99 at ``--rows`` <= 1.3x at 0;
  beside them, the same first row inserted and committed on the bare driver (the bound);
* four threads of first deliveries on the big table, p99 without and while ``purge`` deletes the
  rows older than ``--purge-older-than-s`` (target <= 2x), and the purge's rows/s (≥ 50,000);
* then the next tenth of the table's age, in ten slices, ``purge`` and the same statement on the
  bare driver taking turns: what bounds the purge, in the same run.

    python bench/big_table.py [--only postgres,mariadb] [--rows 10000000] [--mid 1000000]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import idemq

URLS = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
CONSUMERS = 4


def fill(store: idemq.SqlStore, rows: int, spread_s: int) -> None:
    """``rows`` processed rows over four consumers, in chunks of a million."""
    table = store.table.name
    with store.engine.begin() as conn:
        have = conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
    for first in range(have + 1, rows + 1, 1_000_000):
        last = min(first + 999_999, rows)
        with store.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(
                    f"INSERT INTO {table} (consumer, message_id, status, result,"
                    " processed_time, created_time, attempts) SELECT 'c' || mod(g, 4),"
                    f" 'FILL_' || g, 1, '1', (now() AT TIME ZONE 'UTC') - mod(g, {spread_s})"
                    f" * interval '1 second', now(), 1 FROM generate_series({first}, {last}) g"
                )
            else:
                conn.exec_driver_sql(
                    f"INSERT INTO {table} (consumer, message_id, status, result,"
                    " processed_time, created_time, attempts) SELECT CONCAT('c', MOD(seq, 4)),"
                    f" CONCAT('FILL_', seq), 1, '1', UTC_TIMESTAMP(6) - INTERVAL MOD(seq,"
                    f" {spread_s}) SECOND, NOW(), 1 FROM seq_{first}_to_{last}"
                )
        print(f"    {table}: {last:,} rows", flush=True)
    with store.engine.begin() as conn:
        analyse = "ANALYZE" if conn.dialect.name == "postgresql" else "ANALYZE TABLE"
        conn.exec_driver_sql(f"{analyse} {table}")


def timed(fn: object, *args: object) -> float:
    started = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - started


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def claims(guard: idemq.Idempotency, rows: int, chunk: int) -> tuple[list[float], list[float]]:
    first = [timed(guard.process, f"NEW_{uuid.uuid4().hex}", lambda tx: 1) for _ in range(chunk)]
    dups = [
        timed(guard.process, f"FILL_{random.randrange(1, rows + 1)}", lambda tx: 1)
        for _ in range(chunk if rows else 0)
    ]
    return first, dups


# The bound of a first delivery: one row inserted and committed on the bare driver, into the
# same table (its primary key and indexes), without idemq.
BARE_INSERT = {
    "postgresql": (
        "INSERT INTO {t} (consumer, message_id, status, result, processed_time, created_time,"
        " attempts) VALUES (%(c)s, %(m)s, 1, '1', now(), now(), 1) ON CONFLICT DO NOTHING"
    ),
    "mysql": (
        "INSERT IGNORE INTO {t} (consumer, message_id, status, result, processed_time,"
        " created_time, attempts) VALUES (%(c)s, %(m)s, 1, '1', UTC_TIMESTAMP(6), NOW(), 1)"
    ),
}


def bare_firsts(store: idemq.SqlStore, consumer: str, chunk: int) -> list[float]:
    name = store.engine.dialect.name
    sql = BARE_INSERT["postgresql" if name == "postgresql" else "mysql"].format(t=store.table.name)
    raw = store.engine.raw_connection()
    out = []
    try:
        for _ in range(chunk):
            started = time.perf_counter()
            cursor = raw.cursor()
            cursor.execute(sql, {"c": consumer, "m": f"BARE_{uuid.uuid4().hex}"})
            cursor.close()
            raw.commit()
            out.append(time.perf_counter() - started)
    finally:
        raw.close()
    return out


def threads_p99(store: idemq.SqlStore, seconds: float) -> list[float]:
    """Four threads of first deliveries for ``seconds``; every latency."""
    out: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def work() -> None:
        guard = idemq.Idempotency(store, consumer="c0")
        mine = []
        while time.monotonic() < stop:
            mine.append(timed(guard.process, f"T_{uuid.uuid4().hex}", lambda tx: 1))
        with lock:
            out.extend(mine)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out


def run(db: str, args: argparse.Namespace) -> None:
    sizes = {"0": 0, "m": args.mid, "n": args.rows}
    stores = {}
    for name, rows in sizes.items():
        store = idemq.SqlStore(URLS[db], table=f"bench_bt_{name}", pool_size=8)
        if args.refill:
            store.drop_schema()
        store.create_schema()
        if rows:
            fill(store, rows, args.spread_s)
        stores[name] = store
    first: dict[str, list[float]] = {n: [] for n in sizes}
    dups: dict[str, list[float]] = {n: [] for n in sizes}
    bare: dict[str, list[float]] = {n: [] for n in sizes}
    for rnd in range(args.rounds):
        order = list(sizes) if rnd % 2 == 0 else list(sizes)[::-1]
        for name in order:
            guard = idemq.Idempotency(stores[name], consumer=f"c{rnd % CONSUMERS}")
            f, d = claims(guard, sizes[name], args.chunk)
            first[name] += f
            dups[name] += d
            bare[name] += bare_firsts(stores[name], f"c{rnd % CONSUMERS}", args.chunk)
    for name, rows in sizes.items():
        line = f"  {db:8} {rows:>11,} rows: first p50 {pct(first[name], 0.5):6.2f} ms"
        line += f" p99 {pct(first[name], 0.99):6.2f} ms"
        if dups[name]:
            line += f" | duplicate p50 {pct(dups[name], 0.5):6.2f} ms"
            line += f" p99 {pct(dups[name], 0.99):6.2f} ms"
        line += f" | bare insert p50 {pct(bare[name], 0.5):6.2f} ms"
        line += f" p99 {pct(bare[name], 0.99):6.2f} ms"
        print(line)
    ratio = pct(bare["n"], 0.99) / pct(bare["0"], 0.99)
    print(f"  {db:8} bare insert p99 at {args.rows:,} / at 0 rows: {ratio:.2f}x (the bound)")
    for what, samples in (("first", first), ("duplicate", dups)):
        if samples["n"] and samples["0" if what == "first" else "m"]:
            base = "0" if what == "first" else "m"
            ratio = pct(samples["n"], 0.99) / pct(samples[base], 0.99)
            print(f"  {db:8} {what} p99 at {args.rows:,} / at {sizes[base]:,} rows: {ratio:.2f}x")
    big = stores["n"]
    quiet = threads_p99(big, args.purge_window_s)
    busy: list[float] = []
    purged: list[tuple[int, float]] = []

    def purge() -> None:
        started = time.perf_counter()
        n = big.purge(timedelta(seconds=args.purge_older_than_s), batch_size=args.purge_batch)
        purged.append((n, time.perf_counter() - started))

    purger = threading.Thread(target=purge)
    purger.start()
    while purger.is_alive():
        busy += threads_p99(big, min(args.purge_window_s, 5.0))
    purger.join()
    n, seconds = purged[0]
    print(
        f"  {db:8} 4 threads p99: {pct(quiet, 0.99):.2f} ms quiet, {pct(busy, 0.99):.2f} ms"
        f" during the purge ({pct(busy, 0.99) / pct(quiet, 0.99):.2f}x); purge {n:,} rows in"
        f" {seconds:.1f} s = {n / max(seconds, 1e-9):,.0f} rows/s"
    )
    purge_vs_bare(big, args)
    for store in stores.values():
        store.close()


# The statement each dialect's purge runs (idemq.stores.sql.dialects), on the bare driver.
BARE_PURGE = {
    "postgresql": (
        "DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} WHERE status = 1 AND"
        " processed_time < %(cutoff)s ORDER BY processed_time LIMIT %(limit)s)) AND status = 1"
        " AND processed_time < %(cutoff)s"
    ),
    "mysql": (
        "DELETE FROM {t} WHERE status = 1 AND processed_time < %(cutoff)s"
        " ORDER BY processed_time LIMIT %(limit)s"
    ),
}


def bare_purge(store: idemq.SqlStore, older_than_s: float, batch: int) -> int:
    """The purge's own statement in batches on the bare DBAPI connection, committed per batch."""
    name = store.engine.dialect.name
    sql = BARE_PURGE["postgresql" if name == "postgresql" else "mysql"].format(t=store.table.name)
    cutoff = (datetime.now(UTC) - timedelta(seconds=older_than_s)).replace(tzinfo=None)
    raw = store.engine.raw_connection()
    total = 0
    try:
        while True:
            cursor = raw.cursor()
            cursor.execute(sql, {"cutoff": cutoff, "limit": batch})
            deleted = cursor.rowcount
            cursor.close()
            raw.commit()
            total += deleted
            if deleted < batch:
                return total
    finally:
        raw.close()


def purge_vs_bare(big: idemq.SqlStore, args: argparse.Namespace) -> None:
    """The next band of expired rows (ages ``purge_older_than_s - band`` to
    ``purge_older_than_s``) in ten slices, oldest first, idemq's purge and the bare loop taking
    turns: the same statement and batch size, so the ratio is idemq's own overhead."""
    band = args.purge_older_than_s // 10
    step = band / 10
    rows = {"idemq": 0, "bare": 0}
    seconds = {"idemq": 0.0, "bare": 0.0}
    for i in range(10):
        older_than_s = args.purge_older_than_s - (i + 1) * step
        who = "idemq" if i % 2 == 0 else "bare"
        started = time.perf_counter()
        if who == "idemq":
            n = big.purge(timedelta(seconds=older_than_s), batch_size=args.purge_batch)
        else:
            n = bare_purge(big, older_than_s, args.purge_batch)
        seconds[who] += time.perf_counter() - started
        rows[who] += n
    rate = {k: rows[k] / max(seconds[k], 1e-9) for k in rows}
    db = big.engine.dialect.name
    print(
        f"  {db:8} purge, interleaved slices: idemq {rows['idemq']:,} rows at"
        f" {rate['idemq']:,.0f} rows/s, bare driver {rows['bare']:,} rows at"
        f" {rate['bare']:,.0f} rows/s ({rate['idemq'] / max(rate['bare'], 1e-9):.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="postgres,mariadb")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--mid", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--spread-s", type=int, default=100_000)
    parser.add_argument("--purge-older-than-s", type=int, default=90_000)
    parser.add_argument("--purge-window-s", type=float, default=10.0)
    parser.add_argument("--purge-batch", type=int, default=1000, help="rows per purge transaction")
    parser.add_argument("--refill", action="store_true")
    args = parser.parse_args()
    import os  # noqa: PLC0415

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for db in args.only.split(","):
        run(db, args)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
