"""RedisStore throughput next to hand-written Redis loops and Powertools' Redis idempotency layer.

Run:  python bench/redis_store.py [--url redis://127.0.0.1:6379/0] [-n 20000] [--rounds 3]

Two passes per contender, each over N fresh message ids:
* first pass  — a new message: claim, then mark done (idemq: ``SET … NX PX … GET`` + the
  complete script);
* duplicates  — every id already done: the claim must answer "duplicate" (idemq: one
  ``SET … NX PX … GET`` that returns the stored record, so the result can be replayed).
Baselines: ``SET k P NX PX`` then ``SET k D XX EX`` (first pass), a bare ``SET k P NX``
(duplicates). The duplicate pass also times the claim's own command, reply unparsed, so the
steps from a bare ``SET NX`` to the guard read as µs per message. Powertools
(``idempotent_function`` + its Redis layer) is measured when importable: install it into a
separate venv, never into idemq's dependencies, and put both on the path, e.g.
``PYTHONPATH=src /tmp/benchvenv/bin/python bench/redis_store.py``.
All contenders share one client (one connection pool) and, after a warm-up, take turns in
chunks of 500 messages (order rotating) for ``--rounds`` x N messages each; a contender's rate
is its messages over its time. Prints msg/s per contender, the ratios against the targets of
issue 4 and the load average before and after (ratios from a loaded machine say little: rerun
when it is quiet).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import redis

import idemq
from idemq.stores.base import ClaimRequest, Key
from idemq.stores.redis import ops
from idemq.stores.redis.store import RedisStore

LEASE_MS = 30_000
TTL_S = 3_600
CHUNK = 500  # messages per contender's turn
Loop = Callable[[list[str]], None]


def bare_first(client: redis.Redis) -> Loop:
    def loop(ids: list[str]) -> None:
        for key in ids:
            client.set(key, "P", nx=True, px=LEASE_MS)
            client.set(key, '{"ok":true}', xx=True, ex=TTL_S)

    return loop


def bare_setnx(client: redis.Redis) -> Loop:
    def loop(ids: list[str]) -> None:
        for key in ids:
            client.set(key, "P", nx=True, px=LEASE_MS)

    return loop


def idemq_primitives(store: RedisStore, duplicate: bool) -> Loop:
    consumer = "bench"

    def loop(ids: list[str]) -> None:
        now_ms = time.time_ns() // 1_000_000
        for n, message_id in enumerate(ids):
            owner = f"w{n}"
            request = ClaimRequest(Key(consumer, message_id), None, None, owner, now_ms, LEASE_MS)
            claim = store.claim(request)
            if claim.acquired:
                store.complete(request.key, owner, '{"ok":true}', now_ms)
            elif duplicate and (claim.record is None or claim.record.result is None):
                raise AssertionError("duplicate pass did not see the stored result")

    return loop


def claim_command(store: RedisStore) -> Loop:
    """The claim's own ``SET … NX PX … GET`` through redis-py, its reply left unparsed."""
    consumer = "bench"
    client = store.client
    layout = ops.Layout.build(store.prefix, TTL_S)  # the store's key layout, so its own command

    def loop(ids: list[str]) -> None:
        now_ms = time.time_ns() // 1_000_000
        for n, message_id in enumerate(ids):
            request = ClaimRequest(Key(consumer, message_id), None, None, f"w{n}", now_ms, LEASE_MS)
            ops.claim_set(layout, request).run_on(client)

    return loop


def idemq_guard(store: RedisStore) -> Loop:
    guard = idemq.Idempotency(store, consumer="bench-guard", mode="lease", lease_s=30)

    def handler(tx: object) -> dict[str, bool]:
        return {"ok": True}

    def loop(ids: list[str]) -> None:
        for message_id in ids:
            guard.process(message_id, handler)

    return loop


def powertools(client: redis.Redis) -> Loop | None:
    try:
        from aws_lambda_powertools.utilities.idempotency import (  # noqa: PLC0415
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (  # noqa: PLC0415
            CachePersistenceLayer,
        )
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = CachePersistenceLayer(client=client, ssl=False)
    config = IdempotencyConfig(expires_after_seconds=TTL_S)

    @idempotent_function(
        data_keyword_argument="order", persistence_store=layer, config=config, key_prefix="benchpt"
    )
    def handle(order: dict[str, str]) -> dict[str, bool]:
        return {"ok": True}

    def loop(ids: list[str]) -> None:
        for message_id in ids:
            handle(order={"id": message_id})

    return loop


def interleaved(
    client: redis.Redis, contenders: list[tuple[str, Loop, Loop | None]], n: int, rounds: int
) -> dict[str, float]:
    """msg/s per contender over ``rounds`` x ``n`` fresh ids each, in chunks of :data:`CHUNK`.

    Contenders take turns chunk by chunk (the order rotating), so a slow second on a shared
    machine hits every contender alike: a whole pass per contender, seconds apart, let one of
    them catch a noisy stretch the others missed (seen here: ±15 % between rounds, more than
    the gaps being measured). Rates are totals — messages over time spent — not best-of.
    """
    spent = dict.fromkeys((name for name, _, _ in contenders), 0.0)
    done = dict.fromkeys(spent, 0)
    # Each contender its own ids: a first-pass and a duplicate contender share a store and a
    # consumer, and ids shared between them turned some first-pass turns into duplicates.
    order = list(enumerate(contenders))
    for _ in range(rounds):
        tag = uuid.uuid4().hex[:8]
        for start in range(0, n, CHUNK):
            order = order[1:] + order[:1]
            for index, (name, loop, prefill) in order:
                ids = [f"bench:{tag}:c{index}:{i:06d}" for i in range(start, min(n, start + CHUNK))]
                if prefill is not None:
                    prefill(ids)
                started = time.perf_counter()
                loop(ids)
                spent[name] += time.perf_counter() - started
                done[name] += len(ids)
        _cleanup(client)
    return {name: done[name] / spent[name] for name in spent}


def warm_up(client: redis.Redis, loop: Loop, prefill: Loop | None) -> None:
    warm = [f"benchwarm:{uuid.uuid4().hex}:{i}" for i in range(1000)]
    (prefill or loop)(warm)
    loop(warm)
    _cleanup(client)


def _cleanup(client: redis.Redis) -> None:
    # Only this bench's own namespaces: the Redis may be shared with other runs.
    for pattern in ("bench:*", "benchwarm:*", "idemqbench:*", "benchpt#*"):
        batch: list[Any] = []
        for key in client.scan_iter(match=pattern, count=5000):
            batch.append(key)
            if len(batch) >= 1000:
                client.unlink(*batch)
                batch.clear()
        if batch:
            client.unlink(*batch)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("-n", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.url)
    client.ping()
    store = RedisStore(client, prefix="idemqbench", ttl_s=TTL_S)
    n, rounds = args.n, args.rounds
    print(f"redis_store bench: {rounds} x N={n} per contender, turns of {CHUNK}, {args.url}")
    print(f"load average before: {_load()}")

    first: list[tuple[str, Loop, Loop | None]] = [
        ("bare SET NX PX + SET XX EX", bare_first(client), None),
        ("idemq RedisStore claim+complete", idemq_primitives(store, duplicate=False), None),
        ("idemq Idempotency(lease)", idemq_guard(store), None),
    ]
    dups: list[tuple[str, Loop, Loop | None]] = [
        ("bare SET NX", bare_setnx(client), bare_first(client)),
        # Not a contender: where a duplicate's time goes, between the bare command and the store.
        ("claim command, reply unparsed", claim_command(store), idemq_primitives(store, False)),
        (
            "idemq RedisStore claim (dup)",
            idemq_primitives(store, duplicate=True),
            idemq_primitives(store, duplicate=False),
        ),
        ("idemq Idempotency(lease) (dup)", idemq_guard(store), idemq_guard(store)),
    ]
    pt = powertools(client)
    if pt is not None:
        first.append(("powertools idempotent_function", pt, None))
        dups.append(("powertools (dup)", pt, pt))
    contenders = first + dups
    for _, loop, prefill in contenders:
        warm_up(client, loop, prefill)
    results = interleaved(client, contenders, n, rounds)
    for title, group in (("first pass (new messages):", first), ("duplicate pass:", dups)):
        print(title)
        for name, _, _ in group:
            print(f"  {name:<34} {results[name]:>10,.0f} msg/s {1e6 / results[name]:7.1f} us/msg")
    if pt is None:
        print("powertools: not installed (install aws-lambda-powertools in a separate venv)")

    print("ratios (target):")

    def ratio(a: str, b: str, target: float) -> None:
        value = results[a] / results[b]
        verdict = "ok" if value >= target else "BELOW TARGET"
        print(f"  {a} / {b}: {value:.2f}x (>= {target}x) {verdict}")

    ratio("idemq RedisStore claim+complete", "bare SET NX PX + SET XX EX", 0.85)
    ratio("idemq Idempotency(lease)", "bare SET NX PX + SET XX EX", 0.85)
    ratio("idemq RedisStore claim (dup)", "bare SET NX", 0.85)
    ratio("idemq Idempotency(lease) (dup)", "bare SET NX", 0.85)
    if pt is not None:
        ratio("idemq RedisStore claim+complete", "powertools idempotent_function", 1.2)
        ratio("idemq Idempotency(lease)", "powertools idempotent_function", 1.2)
        ratio("idemq RedisStore claim (dup)", "powertools (dup)", 3.0)
        ratio("idemq Idempotency(lease) (dup)", "powertools (dup)", 3.0)
    print(f"load average after: {_load()}")
    client.close()


if __name__ == "__main__":
    main()
