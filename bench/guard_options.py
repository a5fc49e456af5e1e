"""What the guard's options cost or save, each next to the same guard without it, same run.

Run:  python bench/guard_options.py [-n 4000] [--rounds 3] [--only redis,postgres]

On Redis and on PostgreSQL, through the sync ``Idempotency`` in lease mode (lease_s=30):

* duplicates with ``local_cache=`` vs without — every id was processed by the same guard just
  before (the redelivery storm the cache is for); bound: the same ids looked up in a dict;
* first deliveries with renewal on (the default) vs ``renew=False``;
* PostgreSQL: lease-mode duplicates vs transactional-mode duplicates; bound: a bare
  primary-key ``SELECT`` of the record per duplicate on the same engine, which is what a
  duplicate that writes nothing costs at least.

Contenders take turns in chunks of 250 messages (order rotating) for ``--rounds`` x N fresh ids
each; a duplicate contender's ids are first processed by its own guard, untimed. A contender's
rate is its messages over its time. Prints msg/s, the ratios against the targets of issue 21 and
the load average before and after; the ratios also by the bench thread's own CPU time
(``time.thread_time``), which a machine loaded by other work disturbs far less than wall time
(the round trips are the same for both contenders of each pair).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import sqlalchemy as sa

import idemq

REDIS_URL = "redis://127.0.0.1:6379/0"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
LEASE_TABLE = "bench_options_lease"
TX_TABLE = "bench_options_tx"
CHUNK = 250
Loop = Callable[[list[str]], None]


@dataclass
class Contender:
    name: str
    loop: Loop
    prefill: Loop | None = None  # run untimed on the same ids first (duplicate contenders)


def guard_loop(guard: idemq.Idempotency, expect: idemq.Status) -> Loop:
    def handler(_tx: object) -> dict[str, bool]:
        return {"ok": True}

    def loop(ids: list[str]) -> None:
        for message_id in ids:
            outcome = guard.process(message_id, handler)
            if outcome.status is not expect or outcome.result != {"ok": True}:
                raise AssertionError(f"{message_id}: {outcome.status} {outcome.result!r}")

    return loop


def first_and_dup(guard: idemq.Idempotency, name: str) -> tuple[Contender, Contender]:
    """The guard's first deliveries, and its duplicates of ids it processed just before."""
    first = guard_loop(guard, idemq.Status.PROCESSED)
    return (
        Contender(f"{name} first", first),
        Contender(f"{name} dup", guard_loop(guard, idemq.Status.DUPLICATE), first),
    )


def dict_bound() -> Contender:
    records: dict[str, str] = {}

    def prefill(ids: list[str]) -> None:
        records.update((i, '{"ok":true}') for i in ids)

    def loop(ids: list[str]) -> None:
        for message_id in ids:
            if records.get(message_id) is None:
                raise AssertionError(message_id)

    return Contender("bound: dict lookup", loop, prefill)


def select_bound(engine: sa.Engine, table: str, prefill: Loop) -> Contender:
    """A bare primary-key SELECT of each record, written first by ``prefill`` (a guard of
    consumer ``bound`` on the same table)."""
    select = sa.text(f"SELECT status, result FROM {table} WHERE consumer = :c AND message_id = :m")

    def loop(ids: list[str]) -> None:
        for message_id in ids:
            with engine.connect() as conn:
                if conn.execute(select, {"c": "bound", "m": message_id}).first() is None:
                    raise AssertionError(message_id)
                conn.commit()

    return Contender("bound: bare SELECT", loop, prefill)


def interleaved(
    contenders: list[Contender], n: int, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """msg/s per contender over its wall time, and over its own thread's CPU time."""
    spent = dict.fromkeys((c.name for c in contenders), 0.0)
    cpu = dict.fromkeys(spent, 0.0)
    done = dict.fromkeys(spent, 0)
    order = list(enumerate(contenders))
    for _ in range(rounds):
        tag = uuid.uuid4().hex[:8]
        for start in range(0, n, CHUNK):
            order = order[1:] + order[:1]
            for index, contender in order:
                ids = [f"o{tag}c{index}-{i:06d}" for i in range(start, min(n, start + CHUNK))]
                if contender.prefill is not None:
                    contender.prefill(ids)
                started, started_cpu = time.perf_counter(), time.thread_time()
                contender.loop(ids)
                spent[contender.name] += time.perf_counter() - started
                cpu[contender.name] += time.thread_time() - started_cpu
                done[contender.name] += len(ids)
    return (
        {name: done[name] / spent[name] for name in spent},
        {name: done[name] / cpu[name] for name in cpu},
    )


def warm_up(contenders: list[Contender]) -> None:
    ids = [f"warm{uuid.uuid4().hex[:8]}-{i}" for i in range(200)]
    for index, contender in enumerate(contenders):
        mine = [f"{i}c{index}" for i in ids]
        if contender.prefill is not None:
            contender.prefill(mine)
        contender.loop(mine)


def redis_contenders() -> tuple[list[Contender], Callable[[], None]]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    store = idemq.RedisStore(client, prefix="benchopt", ttl_s=3600)

    def guard(consumer: str, **options: Any) -> idemq.Idempotency:
        return idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30, **options)

    _, no_cache = first_and_dup(guard("nocache"), "lease")
    _, cached = first_and_dup(guard("cache", local_cache=100_000), "lease, local_cache")
    renew_on, _ = first_and_dup(guard("renew"), "lease, renew on")
    renew_off, _ = first_and_dup(guard("norenew", renew=False), "lease, renew off")

    def close() -> None:
        batch = list(client.scan_iter(match="benchopt:*", count=5000))
        for start in range(0, len(batch), 1000):
            client.unlink(*batch[start : start + 1000])
        client.close()

    return [no_cache, cached, dict_bound(), renew_on, renew_off], close


def pg_contenders() -> tuple[list[Contender], Callable[[], None]]:
    lease_store = idemq.SqlStore(PG_URL, table=LEASE_TABLE)
    tx_store = idemq.SqlStore(PG_URL, table=TX_TABLE)
    for store in (lease_store, tx_store):
        store.drop_schema()
        store.create_schema()

    def guard(consumer: str, **options: Any) -> idemq.Idempotency:
        return idemq.Idempotency(
            lease_store, consumer=consumer, mode="lease", lease_s=30, **options
        )

    _, no_cache = first_and_dup(guard("nocache"), "lease")
    _, cached = first_and_dup(guard("cache", local_cache=100_000), "lease, local_cache")
    renew_on, _ = first_and_dup(guard("renew"), "lease, renew on")
    renew_off, _ = first_and_dup(guard("norenew", renew=False), "lease, renew off")
    transactional = idemq.Idempotency(tx_store, consumer="tx", mode="transactional")
    _, tx_dup = first_and_dup(transactional, "transactional")

    def close() -> None:
        for store in (lease_store, tx_store):
            store.drop_schema()
            store.close()

    contenders = [no_cache, cached, dict_bound(), renew_on, renew_off, tx_dup]
    bound_prefill = guard_loop(guard("bound"), idemq.Status.PROCESSED)
    contenders.append(select_bound(lease_store.engine, LEASE_TABLE, bound_prefill))
    return contenders, close


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ratio(results: dict[str, float], a: str, b: str, target: float | None) -> None:
    value = results[a] / results[b]
    if target is None:
        print(f"  {a} / {b}: {value:.2f}x")
        return
    verdict = "ok" if value >= target else "BELOW TARGET"
    print(f"  {a} / {b}: {value:.2f}x (>= {target}x) {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="redis,postgres")
    args = parser.parse_args()
    print(f"guard_options bench: {args.rounds} x N={args.n} per contender, turns of {CHUNK}")
    print(f"load average before: {_load()}")
    for backend in args.only.split(","):
        build = {"redis": redis_contenders, "postgres": pg_contenders}[backend]
        contenders, close = build()
        try:
            warm_up(contenders)
            results, per_cpu = interleaved(contenders, args.n, args.rounds)
        finally:
            close()
        print(f"{backend}:")
        for contender in contenders:
            rate = results[contender.name]
            cpu_us = 1e6 / per_cpu[contender.name]
            print(
                f"  {contender.name:<30} {rate:>10,.0f} msg/s {1e6 / rate:8.1f} us/msg"
                f" {cpu_us:8.1f} us CPU/msg"
            )
        for title, rates in (("wall time", results), ("this process's CPU time", per_cpu)):
            print(f"  ratios by {title} (target):")
            ratio(rates, "lease, local_cache dup", "lease dup", 10)
            ratio(rates, "lease, renew on first", "lease, renew off first", 0.95)
            if backend == "postgres":
                ratio(rates, "lease dup", "transactional dup", 0.95)
                ratio(rates, "lease dup", "bound: bare SELECT", None)
                ratio(rates, "transactional dup", "bound: bare SELECT", None)
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
