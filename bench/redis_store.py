"""RedisStore and the guard next to hand-written Redis loops (and Powertools' Redis layer).

Run:  python bench/redis_store.py [--url redis://127.0.0.1:6379/0] [-n 5000] [--rounds 2]

Two passes per contender, each over N fresh message ids:
* first pass  — a new message: claim, then mark done (idemq: the claim script, then the
  complete script, both by EVALSHA);
* duplicates  — every id already done: the claim must answer "duplicate" (idemq: the claim
  script, whose reply is the stored record, so the result can be replayed).
The asyncio guard runs a plain handler and, in a row of its own on the first pass, an ``async
def`` one (its claim renewed while it is awaited, as a lease-mode guard does for every
coroutine handler). Baselines: ``SET k P NX PX`` then ``SET k D XX EX`` (first pass), a bare
``SET k P NX`` (duplicates), on the sync and on the asyncio client. The *bound* rows send
idemq's own EVALSHA calls through ``execute_command`` with no idemq code per message, reply
unparsed: the gap from the bare command to the bound is the server's work (a Lua script instead
of a native SET) and the longer command; from the bound to the store, the store's own Python;
from the store to the guard, the guard's. Powertools (``idempotent_function`` + its Redis layer) is
measured when importable: install it into a separate venv, never into idemq's dependencies,
and put both on the path, e.g. ``PYTHONPATH=src /tmp/benchvenv/bin/python bench/redis_store.py``.

All contenders share one client (one connection pool; the asyncio ones one asyncio client)
and, after a warm-up, take turns in chunks of 500 messages (order rotating) for ``--rounds``
x N messages each. A contender's rate is its messages over its wall time, and its client CPU
is the process's CPU time over its turns (on a machine whose cores also run Redis, client CPU
is throughput). Prints msg/s and µs/msg per contender, the ratios against the targets of
issue 31 and the load average before and after (ratios from a loaded machine say little:
rerun when it is quiet).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio

import idemq
from idemq.stores.base import ClaimRequest, Key
from idemq.stores.redis import scripts
from idemq.stores.redis.keys import Layout
from idemq.stores.redis.store import AsyncRedisStore, RedisStore

LEASE_MS = 30_000
TTL_S = 3_600
PREFIX = "idemqbench"
RESULT = '{"ok":true}'
CHUNK = 500  # messages per contender's turn
Loop = Callable[[list[str]], None]


def bare_first(client: redis.Redis) -> Loop:
    def loop(ids: list[str]) -> None:
        for key in ids:
            client.set(key, "P", nx=True, px=LEASE_MS)
            client.set(key, RESULT, xx=True, ex=TTL_S)

    return loop


def bare_setnx(client: redis.Redis) -> Loop:
    def loop(ids: list[str]) -> None:
        for key in ids:
            client.set(key, "P", nx=True, px=LEASE_MS)

    return loop


def bound(client: redis.Redis, complete: bool) -> Loop:
    """idemq's claim (and complete) script calls by EVALSHA on the bare client: the same
    commands the store sends on Redis's clock, with no idemq code per message."""
    claim_sha = client.script_load(scripts.CLAIM.source)
    complete_sha = client.script_load(scripts.COMPLETE.source)
    layout = Layout.build(PREFIX, TTL_S)
    gc_ms = LEASE_MS + layout.ttl_ms

    def loop(ids: list[str]) -> None:
        for n, message_id in enumerate(ids):
            key = layout.key(Key("bench", message_id))
            owner = f"w{n}"
            client.execute_command("EVALSHA", claim_sha, 1, key, owner, "", LEASE_MS, gc_ms, "", "")
            if complete:
                client.execute_command(
                    "EVALSHA", complete_sha, 1, key, owner, RESULT, "", layout.ttl_ms
                )

    return loop


def _check(duplicate: bool, claim: Any) -> None:
    if duplicate and (claim.acquired or claim.record is None or claim.record.result is None):
        raise AssertionError("duplicate pass did not see the stored result")


def idemq_primitives(store: RedisStore, duplicate: bool) -> Loop:
    def loop(ids: list[str]) -> None:
        now_ms = time.time_ns() // 1_000_000
        for n, message_id in enumerate(ids):
            owner = f"w{n}"
            request = ClaimRequest(Key("bench", message_id), None, None, owner, now_ms, LEASE_MS)
            claim = store.claim(request)
            if claim.acquired:
                store.complete(request.key, owner, RESULT, now_ms)
            _check(duplicate, claim)

    return loop


def idemq_guard(store: RedisStore) -> Loop:
    guard = idemq.Idempotency(store, consumer="bench-guard", mode="lease", lease_s=30)

    def handler(tx: object) -> dict[str, bool]:
        return {"ok": True}

    def loop(ids: list[str]) -> None:
        for message_id in ids:
            guard.process(message_id, handler)

    return loop


def on_loop(runner: asyncio.Runner, body: Callable[[list[str]], Awaitable[None]]) -> Loop:
    """An asyncio contender as a :data:`Loop`: each turn runs on the one event loop."""

    def loop(ids: list[str]) -> None:
        runner.run(body(ids))

    return loop


def async_bare_first(runner: asyncio.Runner, client: redis.asyncio.Redis) -> Loop:
    async def body(ids: list[str]) -> None:
        for key in ids:
            await client.set(key, "P", nx=True, px=LEASE_MS)
            await client.set(key, RESULT, xx=True, ex=TTL_S)

    return on_loop(runner, body)


def async_bare_setnx(runner: asyncio.Runner, client: redis.asyncio.Redis) -> Loop:
    async def body(ids: list[str]) -> None:
        for key in ids:
            await client.set(key, "P", nx=True, px=LEASE_MS)

    return on_loop(runner, body)


def async_bound(runner: asyncio.Runner, client: redis.asyncio.Redis, complete: bool) -> Loop:
    """:func:`bound` on the asyncio client."""
    claim_sha = runner.run(client.script_load(scripts.CLAIM.source))
    complete_sha = runner.run(client.script_load(scripts.COMPLETE.source))
    layout = Layout.build(PREFIX, TTL_S)
    gc_ms = LEASE_MS + layout.ttl_ms

    async def body(ids: list[str]) -> None:
        for n, message_id in enumerate(ids):
            key = layout.key(Key("bench", message_id))
            owner = f"w{n}"
            await client.execute_command(
                "EVALSHA", claim_sha, 1, key, owner, "", LEASE_MS, gc_ms, "", ""
            )
            if complete:
                await client.execute_command(
                    "EVALSHA", complete_sha, 1, key, owner, RESULT, "", layout.ttl_ms
                )

    return on_loop(runner, body)


def async_primitives(runner: asyncio.Runner, store: AsyncRedisStore, duplicate: bool) -> Loop:
    async def body(ids: list[str]) -> None:
        now_ms = time.time_ns() // 1_000_000
        for n, message_id in enumerate(ids):
            owner = f"w{n}"
            request = ClaimRequest(Key("bench", message_id), None, None, owner, now_ms, LEASE_MS)
            claim = await store.claim(request)
            if claim.acquired:
                await store.complete(request.key, owner, RESULT, now_ms)
            _check(duplicate, claim)

    return on_loop(runner, body)


def async_guard(runner: asyncio.Runner, store: AsyncRedisStore, *, coroutine: bool = False) -> Loop:
    """AsyncIdempotency over ``store`` with a plain handler, or (``coroutine``) an async one,
    whose claim the guard renews while it is awaited."""
    guard = idemq.AsyncIdempotency(store, consumer="bench-aguard", mode="lease", lease_s=30)

    def handler(tx: object) -> dict[str, bool]:
        return {"ok": True}

    async def async_handler(tx: object) -> dict[str, bool]:
        return {"ok": True}

    chosen = async_handler if coroutine else handler

    async def body(ids: list[str]) -> None:
        for message_id in ids:
            await guard.process(message_id, chosen)

    return on_loop(runner, body)


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


Contender = tuple[str, Loop, Loop | None]  # name, loop, prefill (the duplicates' first pass)


def interleaved(
    client: redis.Redis, contenders: list[Contender], n: int, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """msg/s and client CPU µs/msg per contender over ``rounds`` x ``n`` fresh ids each, in
    chunks of :data:`CHUNK`.

    Contenders take turns chunk by chunk (the order rotating), so a slow second on a shared
    machine hits every contender alike: a whole pass per contender, seconds apart, let one of
    them catch a noisy stretch the others missed (seen here: ±15 % between rounds, more than
    the gaps being measured). Rates are totals — messages over time spent — not best-of.
    """
    spent = dict.fromkeys((name for name, _, _ in contenders), 0.0)
    cpu = dict.fromkeys(spent, 0.0)
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
                started, started_cpu = time.perf_counter(), time.process_time()
                loop(ids)
                cpu[name] += time.process_time() - started_cpu
                spent[name] += time.perf_counter() - started
                done[name] += len(ids)
        _cleanup(client)
    rates = {name: done[name] / spent[name] for name in spent}
    cpu_us = {name: cpu[name] / done[name] * 1e6 for name in spent}
    return rates, cpu_us


def warm_up(client: redis.Redis, loop: Loop, prefill: Loop | None) -> None:
    warm = [f"benchwarm:{uuid.uuid4().hex}:{i}" for i in range(1000)]
    (prefill or loop)(warm)
    loop(warm)
    _cleanup(client)


def _cleanup(client: redis.Redis) -> None:
    # Only this bench's own namespaces: the Redis may be shared with other runs.
    for pattern in ("bench:*", "benchwarm:*", f"{PREFIX}:*", "benchpt#*"):
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
    parser.add_argument("-n", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.url)
    client.ping()
    store = RedisStore(client, prefix=PREFIX, ttl_s=TTL_S)
    runner = asyncio.Runner()
    aclient = redis.asyncio.Redis.from_url(args.url)
    astore = AsyncRedisStore(aclient, prefix=PREFIX, ttl_s=TTL_S)
    n, rounds = args.n, args.rounds
    print(f"redis_store bench: {rounds} x N={n} per contender, turns of {CHUNK}, {args.url}")
    print(f"load average before: {_load()}")

    first: list[Contender] = [
        ("bare SET NX PX + SET XX EX", bare_first(client), None),
        ("bound: claim+complete EVALSHA", bound(client, complete=True), None),
        ("idemq RedisStore claim+complete", idemq_primitives(store, duplicate=False), None),
        ("idemq Idempotency(lease)", idemq_guard(store), None),
        ("async bare SET NX PX + SET XX EX", async_bare_first(runner, aclient), None),
        ("async bound: claim+complete EVALSHA", async_bound(runner, aclient, True), None),
        ("async AsyncRedisStore claim+compl.", async_primitives(runner, astore, False), None),
        ("async AsyncIdempotency(lease)", async_guard(runner, astore), None),
        (
            "async AsyncIdempotency, async handler",
            async_guard(runner, astore, coroutine=True),
            None,
        ),
    ]
    dups: list[Contender] = [
        ("bare SET NX", bare_setnx(client), bare_first(client)),
        ("bound: claim EVALSHA (dup)", bound(client, complete=False), bound(client, True)),
        (
            "idemq RedisStore claim (dup)",
            idemq_primitives(store, duplicate=True),
            idemq_primitives(store, duplicate=False),
        ),
        ("idemq Idempotency(lease) (dup)", idemq_guard(store), idemq_guard(store)),
        ("async bare SET NX", async_bare_setnx(runner, aclient), async_bare_first(runner, aclient)),
        (
            "async bound: claim EVALSHA (dup)",
            async_bound(runner, aclient, False),
            async_bound(runner, aclient, True),
        ),
        (
            "async AsyncRedisStore claim (dup)",
            async_primitives(runner, astore, duplicate=True),
            async_primitives(runner, astore, duplicate=False),
        ),
        ("async AsyncIdempotency (dup)", async_guard(runner, astore), async_guard(runner, astore)),
    ]
    pt = powertools(client)
    if pt is not None:
        first.append(("powertools idempotent_function", pt, None))
        dups.append(("powertools (dup)", pt, pt))
    contenders = first + dups
    for _, loop, prefill in contenders:
        warm_up(client, loop, prefill)
    results, cpu_us = interleaved(client, contenders, n, rounds)
    for title, group in (("first pass (new messages):", first), ("duplicate pass:", dups)):
        print(title)
        for name, _, _ in group:
            print(
                f"  {name:<36} {results[name]:>8,.0f} msg/s {1e6 / results[name]:7.1f} us/msg"
                f"  client CPU {cpu_us[name]:6.1f} us/msg"
            )
    if pt is None:
        print("powertools: not installed (install aws-lambda-powertools in a separate venv)")

    print("ratios by msg/s (target):")

    def ratio(a: str, b: str, target: float | None = None) -> None:
        value = results[a] / results[b]
        verdict = (
            ""
            if target is None
            else f" (>= {target}x) " + ("ok" if value >= target else "BELOW TARGET")
        )
        print(f"  {a} / {b}: {value:.2f}x{verdict}")

    ratio("idemq Idempotency(lease)", "bare SET NX PX + SET XX EX", 0.9)
    ratio("idemq Idempotency(lease) (dup)", "bare SET NX", 0.9)
    ratio("async AsyncIdempotency(lease)", "async bare SET NX PX + SET XX EX", 0.9)
    ratio("async AsyncIdempotency, async handler", "async bare SET NX PX + SET XX EX", 0.9)
    ratio("async AsyncIdempotency (dup)", "async bare SET NX", 0.9)
    ratio("idemq RedisStore claim+complete", "bare SET NX PX + SET XX EX")
    ratio("idemq RedisStore claim (dup)", "bare SET NX")
    ratio("async AsyncRedisStore claim+compl.", "async bare SET NX PX + SET XX EX")
    ratio("async AsyncRedisStore claim (dup)", "async bare SET NX")
    ratio("bound: claim+complete EVALSHA", "bare SET NX PX + SET XX EX")
    ratio("bound: claim EVALSHA (dup)", "bare SET NX")
    ratio("idemq RedisStore claim+complete", "bound: claim+complete EVALSHA")
    ratio("idemq RedisStore claim (dup)", "bound: claim EVALSHA (dup)")
    ratio("async AsyncRedisStore claim+compl.", "async bound: claim+complete EVALSHA")
    ratio("async AsyncRedisStore claim (dup)", "async bound: claim EVALSHA (dup)")
    if pt is not None:
        ratio("idemq Idempotency(lease)", "powertools idempotent_function", 1.2)
        ratio("idemq Idempotency(lease) (dup)", "powertools (dup)", 3.0)
    print(f"load average after: {_load()}")
    runner.run(aclient.aclose())
    runner.close()
    client.close()


if __name__ == "__main__":
    main()
