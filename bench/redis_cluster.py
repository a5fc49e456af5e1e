"""RedisStore on a Redis Cluster next to the same store on one Redis server, in the same run.

Run:  PYTHONPATH=src:. python bench/redis_cluster.py [--url redis://127.0.0.1:6379/0]
      [--cluster-url redis://127.0.0.1:7000/0?cluster=true] [-n 5000] [--rounds 3]

Without ``--cluster-url`` it starts its own cluster (three masters, three replicas of the
machine's ``redis-server``, as the tests do) and stops it at the end. Per store, one thread:

* first   — ``Idempotency.process`` of a new message in lease mode (claim, handler, complete);
* dup     — the same ids again: each claim answers DUPLICATE;
* batch   — ``process_batch`` of 100 new messages (``claim_many``: one script call for the
  batch on one server, one per hash slot on the cluster).

The two stores take turns in chunks of 500 messages for ``--rounds`` x N each; a rate is its
messages over its time. Prints msg/s per store and pass and the cluster's ratio to one server.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable

import idemq
from idemq.stores.redis.store import RedisStore

CHUNK = 500
BATCH = 100


def passes(store: RedisStore) -> dict[str, Callable[[list[str]], None]]:
    guard = idemq.Idempotency(store, consumer="bench", mode="lease", lease_s=30)

    def first(ids: list[str]) -> None:
        for message_id in ids:
            guard.process(message_id, lambda tx: 1)

    def dup(ids: list[str]) -> None:
        for message_id in ids:
            guard.process(message_id, lambda tx: 1)

    def batch(ids: list[str]) -> None:
        messages = [idemq.Message(id=f"B{m}", body=b"x") for m in ids]
        for start in range(0, len(messages), BATCH):
            guard.process_batch(messages[start : start + BATCH], lambda msg, tx: 1)

    return {"first": first, "dup": dup, "batch": batch}


def cleanup(store: RedisStore) -> None:
    client = store.client
    for key in list(client.scan_iter(match=f"{store.prefix}*", count=1000)):
        client.delete(key)


def run(stores: dict[str, RedisStore], n: int, rounds: int) -> dict[tuple[str, str], float]:
    spent: dict[tuple[str, str], float] = {}
    done: dict[tuple[str, str], int] = {}
    runners = {name: passes(store) for name, store in stores.items()}
    for round_no in range(rounds):
        ids = [f"M{round_no}-{uuid.uuid4().hex[:12]}" for _ in range(n)]
        for pass_name in ("first", "dup", "batch"):
            for start in range(0, n, CHUNK):
                chunk = ids[start : start + CHUNK]
                order = list(runners) if (start // CHUNK) % 2 == 0 else list(runners)[::-1]
                for name in order:
                    began = time.perf_counter()
                    runners[name][pass_name](chunk)
                    key = (name, pass_name)
                    spent[key] = spent.get(key, 0.0) + time.perf_counter() - began
                    done[key] = done.get(key, 0) + len(chunk)
    return {key: done[key] / spent[key] for key in spent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--cluster-url", default=None)
    parser.add_argument("-n", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    started = None
    cluster_url = args.cluster_url
    if cluster_url is None:
        from tests.redis_cluster import start_cluster  # noqa: PLC0415

        started = start_cluster()
        cluster_url = started.url
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    stores = {
        "one server": RedisStore(args.url, prefix=prefix, ttl_s=600),
        "cluster": RedisStore(cluster_url, prefix=prefix, ttl_s=600),
    }
    load_before = os.getloadavg()[0]
    try:
        rates = run(stores, args.n, args.rounds)
    finally:
        for store in stores.values():
            cleanup(store)
            store.close()
        if started is not None:
            started.stop()
    print(f"RedisStore, {args.rounds} x {args.n} messages per pass, one thread")
    for pass_name in ("first", "dup", "batch"):
        one, cluster = rates[("one server", pass_name)], rates[("cluster", pass_name)]
        print(
            f"  {pass_name:<6} one server {one:8.0f} msg/s   cluster {cluster:8.0f} msg/s"
            f"   cluster/one {cluster / one:.2f}"
        )
    print(f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
