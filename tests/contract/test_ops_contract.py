"""The operator primitives on every store: ``stats()`` and ``force_release()``.

Records are written through the guard with a fake clock, so the expected counts, timestamps and
stuck leases are exact on memory, SQLite, PostgreSQL, MariaDB (both plans) and Redis.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import idemq
from idemq.stores.base import ClaimRequest, ForgetResult, Key, RecordStatus, StoreStats
from tests.conftest import unique
from tests.contract.conftest import FakeClock

LEASE_MS = 30_000


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _claim(store: Any, message_id: str, clock: FakeClock, consumer: str = "ops") -> str:
    """A PROCESSING record left behind as by a worker that crashed after its claim."""
    owner = f"owner-{message_id}"
    request = ClaimRequest(Key(consumer, message_id), None, None, owner, clock(), LEASE_MS)
    assert store.claim(request).acquired
    return owner


def _process(store: Any, message_id: str, clock: FakeClock) -> None:
    guard = idemq.Idempotency(store, consumer="ops", mode="lease", lease_s=30, clock=clock)
    assert guard.process(message_id, lambda _tx: {"ok": True}).status is idemq.Status.PROCESSED


def test_stats_of_an_empty_store(store: Any, clock: FakeClock) -> None:
    stats = store.stats(now_ms=clock())
    assert isinstance(stats, StoreStats)
    assert (stats.processing, stats.processed, stats.stuck, stats.total) == (0, 0, 0, 0)
    assert stats.oldest_processing is None
    assert stats.oldest_processed is None
    assert stats.now_ms == clock()
    assert stats.size_method


def test_stats_counts_by_status_oldest_and_stuck(store: Any, clock: FakeClock) -> None:
    first_ms = clock()
    _process(store, "P1", clock)
    clock.advance(1_000)
    _process(store, "P2", clock)
    _process(store, "P3", clock)
    clock.advance(1_000)
    oldest_claim_ms = clock()
    _claim(store, "STUCK", clock)  # its lease ends at oldest_claim_ms + LEASE_MS
    clock.advance(20_000)
    _claim(store, "LIVE", clock)
    clock.advance(15_000)  # STUCK's lease is over, LIVE's is not

    stats = store.stats(now_ms=clock())
    assert (stats.processing, stats.processed, stats.stuck) == (2, 3, 1)
    assert stats.total == 5
    assert stats.oldest_processing == _utc(oldest_claim_ms)
    assert stats.oldest_processed == _utc(first_ms)
    # Judged at the time asked for, not the wall clock: an hour later both leases are stuck.
    assert store.stats(now_ms=clock() + 3_600_000).stuck == 2


def test_stats_size_is_reported_where_the_backend_can_tell(store: Any, clock: FakeClock) -> None:
    for i in range(20):
        _process(store, f"M{i}", clock)
    stats = store.stats(now_ms=clock())
    if isinstance(store, idemq.MemoryStore):
        assert stats.size_bytes is None
    else:
        assert stats.size_bytes is not None
        assert stats.size_bytes > 0


def test_force_release_deletes_a_stuck_claim_whoever_owns_it(store: Any, clock: FakeClock) -> None:
    _claim(store, "M", clock)
    assert store.force_release("M", "ops") is True
    assert store.get("M", "ops") is None
    assert store.stats(now_ms=clock()).processing == 0
    # The message can be processed at once, without waiting for the lease to run out.
    _process(store, "M", clock)
    record = store.get("M", "ops")
    assert record is not None
    assert record.status is RecordStatus.PROCESSED


def test_force_release_never_touches_a_processed_record(store: Any, clock: FakeClock) -> None:
    _process(store, "DONE", clock)
    assert store.force_release("DONE", "ops") is False
    record = store.get("DONE", "ops")
    assert record is not None
    assert record.status is RecordStatus.PROCESSED
    assert record.result == '{"ok":true}'


def test_force_release_of_an_absent_record_and_other_consumers(
    store: Any, clock: FakeClock
) -> None:
    assert store.force_release("NOPE", "ops") is False
    _claim(store, "SHARED", clock, consumer="billing")
    _claim(store, "SHARED", clock, consumer="mailer")
    assert store.force_release("SHARED", "billing") is True
    assert store.get("SHARED", "billing") is None
    mailer = store.get("SHARED", "mailer")
    assert mailer is not None
    assert mailer.status is RecordStatus.PROCESSING
    assert store.force_release("SHARED", "billing") is False


def test_transactional_rows_are_processed_never_stuck(sql_store: Any, clock: FakeClock) -> None:
    guard = idemq.Idempotency(sql_store, consumer="ops", clock=clock)
    for i in range(3):
        guard.process(f"T{i}", lambda _tx: None)
    stats = sql_store.stats(now_ms=clock() + 10**9)
    assert (stats.processing, stats.processed, stats.stuck) == (0, 3, 0)
    assert stats.oldest_processed == _utc(clock())


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mariadb", "redis"])
async def test_async_twins_answer_the_same(kind: str, tmp_path: Path, clock: FakeClock) -> None:
    from tests.contract.test_async_contract import dispose, make_async_store  # noqa: PLC0415

    store = await make_async_store(kind, tmp_path)
    try:
        request = ClaimRequest(Key("ops", "A"), None, None, "o1", clock(), LEASE_MS)
        assert (await store.claim(request)).acquired
        guard = idemq.AsyncIdempotency(store, consumer="ops", mode="lease", lease_s=30, clock=clock)
        await guard.process("B", lambda _tx: 1)
        clock.advance(LEASE_MS)
        stats = await store.stats(now_ms=clock())
        assert (stats.processing, stats.processed, stats.stuck) == (1, 1, 1)
        assert stats.size_bytes is not None
        assert await store.force_release("B", "ops") is False
        assert await store.force_release("A", "ops") is True
        assert await store.get("A", "ops") is None
        assert (await store.stats(now_ms=clock())).processing == 0
    finally:
        await dispose(store)


def test_forget_lets_a_processed_message_run_again(store, clock):
    guard = idemq.Idempotency(
        store, consumer=unique("c"), mode="lease", clock=clock, local_cache=10
    )
    runs = []
    guard.process("M1", lambda _tx: runs.append(1))
    assert guard.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.DUPLICATE
    assert guard.forget("M1") is ForgetResult.FORGOTTEN
    assert guard.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.PROCESSED
    assert runs == [1, 1]  # the local cache forgot it too
    assert guard.forget("never seen") is ForgetResult.NOT_FOUND


def test_forget_refuses_a_live_lease_unless_forced(store, clock):
    consumer = unique("c")
    guard = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30, clock=clock)
    request = ClaimRequest(Key(consumer, "M1"), None, None, "f" * 32, clock(), 30_000)
    assert store.claim(request).acquired  # another worker is mid-effect
    assert guard.forget("M1") is ForgetResult.LIVE_LEASE
    assert store.get("M1", consumer) is not None
    clock.advance(30_001)  # its lease ran out: a stuck claim, which forget may clear
    assert guard.forget("M1") is ForgetResult.FORGOTTEN
    assert store.claim(
        ClaimRequest(Key(consumer, "M2"), None, None, "f" * 32, clock(), 30_000)
    ).acquired
    assert guard.forget("M2", force=True) is ForgetResult.FORGOTTEN
    assert store.get("M2", consumer) is None
