"""A master of the Redis Cluster is SIGKILLed in the middle of 5,000 claims.

What must hold: the run goes on once the master's replica is promoted; every error the callers
see in between is :class:`~idemq.StoreUnavailableError` (never a raw redis-py one), which the
caller's loop retries. What it costs, measured and printed: how long the window was, and how
many claims or completes that Redis had acknowledged vanished with the master (replication is
asynchronous: the master answered before its replica had the write). Each vanished write is a
message that a redelivery would run a second time, and the test proves exactly that: a second
worker's claim wins on those ids, and only on those.

The cluster is this module's own (a killed master would change the session's cluster).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

import idemq
from idemq._clock import system_clock_ms
from idemq.errors import LeaseLostError, StoreUnavailableError
from idemq.stores.base import ClaimRequest, Key, RecordStatus
from tests.conftest import unique
from tests.redis_cluster import RedisCluster, start_cluster

pytestmark = [pytest.mark.redis, pytest.mark.slow]

T = TypeVar("T")
CLAIMS = 5_000
THREADS = 8
KILL_AFTER = 1_500  # completed messages before the master is killed
CONSUMER = "orders"


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    made = start_cluster()
    yield made
    made.stop()


@dataclass
class Tally:
    """What the callers saw: errors by type, the time of each retried failure."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    failed_at: list[float] = field(default_factory=list)
    recovered_at: list[float] = field(default_factory=list)
    won: set[str] = field(default_factory=set)
    lease_lost: set[str] = field(default_factory=set)


def retried(tally: Tally, action: Callable[[], T]) -> T:
    """The caller's loop: retry ``action`` while the store is unavailable."""
    failed = False
    while True:
        try:
            result = action()
        except StoreUnavailableError:
            with tally.lock:
                tally.errors["StoreUnavailableError"] = (
                    tally.errors.get("StoreUnavailableError", 0) + 1
                )
                tally.failed_at.append(time.monotonic())
            failed = True
            time.sleep(0.05)
            continue
        if failed:
            with tally.lock:
                tally.recovered_at.append(time.monotonic())
        return result


def request(message_id: str, owner: str) -> ClaimRequest:
    return ClaimRequest(
        key=Key(CONSUMER, message_id),
        business_id=None,
        payload_hash=None,
        owner=owner,
        now_ms=system_clock_ms(),
        lease_ms=60_000,
    )


def worker(store: idemq.RedisStore, ids: list[str], owner: str, tally: Tally) -> None:
    for message_id in ids:
        claim = retried(tally, lambda m=message_id: store.claim(request(m, owner)))
        if not claim.acquired:  # our own claim, replayed after a lost reply, is still ours
            continue
        with tally.lock:
            tally.won.add(message_id)
        key = Key(CONSUMER, message_id)
        try:
            retried(
                tally, lambda k=key: store.complete(k, owner, '{"ok": true}', system_clock_ms())
            )
        except LeaseLostError:
            # The claim Redis acknowledged vanished with the killed master before its replica
            # had it: the caller is told, stores nothing, and a redelivery runs it again.
            with tally.lock:
                tally.lease_lost.add(message_id)
            continue
        with tally.lock:
            tally.completed += 1


def test_sigkill_of_a_master_during_5000_claims(cluster: RedisCluster) -> None:
    store = idemq.RedisStore(cluster.url, prefix=unique("idemqfo"), ttl_s=600)
    ids = [f"ORDER_{i:05d}" for i in range(CLAIMS)]
    tally = Tally()
    threads = [
        threading.Thread(target=worker, args=(store, ids[n::THREADS], f"w{n}", tally), daemon=True)
        for n in range(THREADS)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    while tally.completed < KILL_AFTER:
        time.sleep(0.01)
    victim = cluster.masters()[0]
    victim.kill()
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=240)
        assert not t.is_alive(), "the run did not go on after the failover"
    elapsed = time.monotonic() - started

    # Every message was claimed and completed once, as far as the callers know.
    assert tally.won == set(ids)
    assert tally.completed + len(tally.lease_lost) == CLAIMS
    # The only error the callers saw was the one they are told to retry.
    assert set(tally.errors) <= {"StoreUnavailableError"}
    cluster.wait_ok(replicas=False)
    assert len(cluster.masters()) == 3, "the replica of the killed master was promoted"

    # What survived: a record per message, PROCESSED, unless the failover lost its write.
    records = {m: store.get(m, CONSUMER) for m in ids}
    vanished = {
        m for m, r in records.items() if r is None or r.status is not RecordStatus.PROCESSED
    }
    # Those are exactly the messages a redelivery runs a second time: a new worker wins them
    # (a lost claim at once, a lost complete once its lease is over), and nothing else.
    later = system_clock_ms() + 120_000
    rerun = set()
    for message_id in ids:
        claim = store.claim(
            ClaimRequest(Key(CONSUMER, message_id), None, None, "redelivery", later, 60_000)
        )
        if claim.acquired:
            rerun.add(message_id)
    assert rerun == vanished
    assert tally.lease_lost <= vanished  # a complete refused only where the claim was lost

    window_s = (max(tally.recovered_at) - killed_at) if tally.recovered_at else 0.0
    print(
        f"\nfailover: {CLAIMS} claims+completes on {THREADS} threads in {elapsed:.1f} s; "
        f"master :{victim.port} SIGKILLed after {KILL_AFTER}; callers retried "
        f"{tally.errors.get('StoreUnavailableError', 0)} StoreUnavailableError over a window "
        f"of {window_s:.1f} s; {len(vanished)} acknowledged writes vanished "
        f"({sum(1 for m in vanished if records[m] is None)} claims, "
        f"{sum(1 for m in vanished if records[m] is not None)} completes): "
        f"those messages would run twice"
    )
    assert tally.failed_at, "killing a master must have been noticed by some caller"
    assert window_s < 60
    store.close()


def test_a_claim_acknowledged_before_the_failover_can_vanish_and_the_message_run_twice(
    cluster: RedisCluster,
) -> None:
    """The cost made certain: the replica is paused (SIGSTOP) and the master drops its link,
    so the claim and the complete the master acknowledges never reach it; the master dies,
    the replica resumes and is promoted; a redelivery of the same message wins a new claim and
    its handler runs a second time."""
    store = idemq.RedisStore(cluster.url, prefix=unique("idemqfo"), ttl_s=600)
    guard = idemq.Idempotency(store, consumer=CONSUMER, mode="lease", lease_s=60)
    effects: list[str] = []
    message_id = "ORDER_1"
    master = cluster.node_of(store._layout.key(Key(CONSUMER, message_id)))
    replica = cluster.replica_of(master)
    replica.pause()
    try:
        admin = master.client()
        admin.client_kill_filter(_type="replica")  # what a network partition does to the link
        admin.close()
        first = guard.process(message_id, lambda tx: effects.append("first worker"))
        assert first.status is idemq.Status.PROCESSED  # acknowledged by the master
        master.kill()
    finally:
        replica.resume()
    cluster.wait_ok(replicas=False)
    assert replica.info("replication")["role"] == "master"

    again = retried(
        Tally(), lambda: guard.process(message_id, lambda tx: effects.append("redelivery"))
    )
    assert again.status is idemq.Status.PROCESSED  # not DUPLICATE: the record was lost
    assert effects == ["first worker", "redelivery"], "the message ran twice"
    store.close()
