"""Renewal when the network fails quietly: a handler hears of a lost lease within one lease, and
one silent connection delays no other handler's renewal.

The store is reached through :class:`SilentProxy`: its connections can fall silent (bytes
vanish, nothing is closed), which a driver without a socket or statement timeout waits on
forever. Before, renewal ran serially from one thread: one silent pooled connection held every
other handler's renewal back, so rivals took their messages over and ran them twice; and a
partition was noticed only after Redis's socket timeout, never on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy.engine import make_url

import idemq
from idemq.guard.context import current_message
from idemq.stores.base import RecordStatus
from tests.conftest import (
    MYSQL_URL,
    PG_URL,
    REDIS_URL,
    redis_cleanup,
    require_service,
    unique,
)
from tests.contract._silent_proxy import SilentProxy

# Renewals go every third of a lease: at 2 s, one delayed 1.2 s by a loaded machine (four xdist
# workers on two cores) read as lost; 3 s leaves them room.
LEASE_S = 3.0

pytestmark = pytest.mark.slow  # real leases lost to silent connections: 4 to 9 s each


@dataclass
class Proxied:
    """A store reached through a silent-able proxy, and the same store reached directly."""

    store: Any
    direct: Any
    proxy: SilentProxy


def _proxied(kind: str) -> Proxied:
    if kind == "redis":
        require_service("redis")
        upstream = urlsplit(REDIS_URL)
        proxy = SilentProxy((upstream.hostname or "127.0.0.1", upstream.port or 6379))
        prefix = unique("idemqtest")
        store = idemq.RedisStore(
            f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix, lease_clock="client"
        )
        direct = idemq.RedisStore(REDIS_URL, prefix=prefix, lease_clock="client")
        return Proxied(store, direct, proxy)
    require_service("postgres" if kind == "postgres" else "mysql")
    url = make_url(PG_URL if kind == "postgres" else MYSQL_URL)
    table = unique("mi")
    direct = idemq.SqlStore(url, table=table, lease_clock="client")
    direct.create_schema()
    proxy = SilentProxy((url.host or "127.0.0.1", url.port or 0))
    store = idemq.SqlStore(url.set(port=proxy.port), table=table, lease_clock="client")
    return Proxied(store, direct, proxy)


def _dispose(made: Proxied) -> None:
    made.proxy.heal()  # ends the silent connections: a thread stuck on one gets its error
    made.proxy.close()
    made.store.close()
    if isinstance(made.direct, idemq.SqlStore):
        made.direct.drop_schema()
    else:
        redis_cleanup(made.direct.prefix)
    made.direct.close()


@pytest.fixture(params=["postgres", "mariadb"])
def sql_proxied(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Proxied]:
    made = _proxied(request.param)
    yield made
    _dispose(made)


@pytest.fixture(params=["redis", "postgres"])
def redis_or_pg_proxied(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Proxied]:
    made = _proxied(request.param)
    yield made
    _dispose(made)


def test_one_silent_connection_stalls_only_its_own_renewal(sql_proxied):
    # Three handlers of one guard, each longer than the lease. One pooled connection falls
    # silent in the middle of STALL's renewal: A's and B's renewals still land (a rival on the
    # direct store never takes them over), and STALL's handler hears within one lease.
    made = sql_proxied
    consumer = unique("c")
    worker = idemq.Idempotency(made.store, consumer=consumer, mode="lease", lease_s=LEASE_S)
    rival = idemq.Idempotency(made.direct, consumer=consumer, mode="lease", lease_s=LEASE_S)
    effects: Counter[str] = Counter()
    lock = threading.Lock()
    started = {m: threading.Event() for m in ("A", "B", "STALL_1")}
    told: dict[str, bool] = {}
    outcomes: dict[str, Any] = {}

    def effect(message_id: str) -> None:
        with lock:
            effects[message_id] += 1

    def handle(message_id: str) -> Any:
        effect(message_id)
        started[message_id].set()
        context = current_message()
        assert context is not None
        if message_id == "STALL_1":
            assert made.proxy.silenced.wait(5 * LEASE_S)
            # Its last confirmed renewal was sent before the silence: lost by then + 0.9 lease.
            told[message_id] = context.wait_lease_lost(LEASE_S)
            raise RuntimeError("lease lost: stop")
        time.sleep(2.5 * LEASE_S)
        told[message_id] = context.lease_lost
        return message_id

    def run(message_id: str) -> None:
        try:
            outcomes[message_id] = worker.process(message_id, lambda _tx: handle(message_id))
        except RuntimeError as exc:
            outcomes[message_id] = exc

    threads = [threading.Thread(target=run, args=(m,)) for m in started]
    for thread in threads:
        thread.start()
    for event in started.values():
        assert event.wait(10)
    made.proxy.silence_next(b"STALL_1")  # its next statement: the renewal
    rival_statuses: Counter[idemq.Status] = Counter()
    while any(thread.is_alive() for thread in threads):
        for message_id in ("A", "B"):
            outcome = rival.process(message_id, lambda _tx, m=message_id: effect(m))
            rival_statuses[outcome.status] += 1
        time.sleep(0.05)
    for thread in threads:
        thread.join(10)

    assert effects == Counter({"A": 1, "B": 1, "STALL_1": 1})  # nothing ran twice
    assert rival_statuses[idemq.Status.PROCESSED] == 0
    assert told == {"A": False, "B": False, "STALL_1": True}
    assert outcomes["A"].status is idemq.Status.PROCESSED
    assert outcomes["B"].status is idemq.Status.PROCESSED


def test_a_lease_is_reported_lost_within_one_lease_when_packets_vanish(redis_or_pg_proxied):
    made = redis_or_pg_proxied
    guard = idemq.Idempotency(made.store, consumer=unique("c"), mode="lease", lease_s=LEASE_S)
    heard: list[tuple[bool, float]] = []

    def handle(_tx: Any) -> None:
        context = current_message()
        assert context is not None
        made.proxy.silence_all()  # every packet to the store vanishes from now on
        began = time.monotonic()
        lost = context.wait_lease_lost(2 * LEASE_S)
        heard.append((lost, time.monotonic() - began))
        made.proxy.heal()
        raise RuntimeError("lease lost: stop")

    with pytest.raises(RuntimeError):
        guard.process("M1", handle)
    lost, after_s = heard[0]
    assert lost
    assert after_s < LEASE_S  # within one lease of the last confirmed renewal


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_an_async_handler_is_cancelled_within_one_lease_when_packets_vanish(kind: str):
    # AsyncIdempotency renews from a task per handler; a renewal that never answers must not
    # hold the verdict back: it is given until the claim would count as lost, no longer.
    if kind == "redis":
        require_service("redis")
        upstream = urlsplit(REDIS_URL)
        proxy = SilentProxy((upstream.hostname or "127.0.0.1", upstream.port or 6379))
    else:
        require_service("postgres")
        url = make_url(PG_URL)
        proxy = SilentProxy((url.host or "127.0.0.1", url.port or 5432))
    cancelled_after_s: list[float] = []

    async def open_store() -> Any:
        if kind == "redis":
            return idemq.AsyncRedisStore(
                f"redis://127.0.0.1:{proxy.port}/0",
                prefix=unique("idemqtest"),
                lease_clock="client",
            )
        store = idemq.AsyncSqlStore(
            make_url(PG_URL).set(port=proxy.port), table=unique("mi"), lease_clock="client"
        )
        await store.create_schema()
        return store

    async def main() -> None:
        store = await open_store()
        guard = idemq.AsyncIdempotency(store, consumer=unique("c"), mode="lease", lease_s=LEASE_S)

        async def handler(_tx: Any) -> None:
            proxy.silence_all()  # every packet to the store vanishes from now on
            began = time.monotonic()
            try:
                await asyncio.sleep(3 * LEASE_S)
            except asyncio.CancelledError:
                cancelled_after_s.append(time.monotonic() - began)
                raise
            finally:
                proxy.heal()

        try:
            with pytest.raises(idemq.LeaseLostError):
                await guard.process("M1", handler)
        finally:
            proxy.heal()
            if isinstance(store, idemq.AsyncSqlStore):
                await store.drop_schema()
            else:
                redis_cleanup(store.prefix)
            await store.close()

    try:
        asyncio.run(main())
    finally:
        proxy.close()
    assert len(cancelled_after_s) == 1
    assert cancelled_after_s[0] < LEASE_S  # within one lease of the last confirmed renewal


def test_with_a_driver_read_timeout_a_silent_connection_costs_one_renewal_not_the_lease():
    # PyMySQL's read_timeout (connect_args, as guard-options documents) frees the connection a
    # renewal is stuck on: that renewal fails, the next one goes out on another connection and
    # lands, and the handler keeps its lease.
    require_service("mysql")
    url, table, lease_s = make_url(MYSQL_URL), unique("mi"), 3.0
    direct = idemq.SqlStore(url, table=table, lease_clock="client")
    direct.create_schema()
    proxy = SilentProxy((url.host or "127.0.0.1", url.port or 3306))
    store = idemq.SqlStore(
        url.set(port=proxy.port),
        table=table,
        lease_clock="client",
        connect_args={"read_timeout": 1},
    )
    consumer = unique("c")
    guard = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=lease_s)
    told: list[bool] = []

    def handle(_tx: Any) -> str:
        context = current_message()
        assert context is not None
        proxy.silence_next(b"SILENT_1")  # its next statement: a renewal
        assert proxy.silenced.wait(2 * lease_s)
        told.append(context.wait_lease_lost(1.5 * lease_s))
        return "done"

    try:
        outcome = guard.process("SILENT_1", handle)
        assert told == [False]
        assert outcome.status is idemq.Status.PROCESSED
        assert direct.get("SILENT_1", consumer).status is RecordStatus.PROCESSED
    finally:
        proxy.heal()
        proxy.close()
        store.close()
        direct.drop_schema()
        direct.close()
