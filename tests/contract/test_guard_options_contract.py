"""The guard's options, on every store: result codecs, waiting duplicates, the local cache.

Each option changes how a duplicate is answered, never whether an effect happens twice: every
test counts handler runs (the effect) as well as the outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa

import idemq
from idemq.guard.codec import DataclassCodec, PydanticCodec
from idemq.stores.base import ClaimRequest, ForgetResult, Key
from tests.conftest import REDIS_URL, redis_cleanup, require_service, unique
from tests.contract.conftest import FakeClock


@dataclasses.dataclass(frozen=True)
class Receipt:
    order_id: str
    cents: int


class Shipment(pydantic.BaseModel):
    order_id: str
    parcels: list[int]


class Counting:
    """A store wrapper that counts claims: the store itself is real, only observed."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.claims = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def claim(self, request: Any) -> Any:
        self.claims += 1
        return self._store.claim(request)


@pytest.mark.parametrize(
    ("codec", "result"),
    [
        (DataclassCodec(Receipt), Receipt("o1", 1250)),
        (PydanticCodec(Shipment), Shipment(order_id="o1", parcels=[1, 2])),
    ],
    ids=["dataclass", "pydantic"],
)
def test_a_typed_result_is_replayed_as_the_same_type(store, clock, codec, result):
    guard = idemq.Idempotency(store, consumer=unique("c"), mode="lease", clock=clock, codec=codec)
    runs = []
    first = guard.process("M1", lambda _tx: runs.append(1) or result)
    again = guard.process("M1", lambda _tx: runs.append(1) or result)
    assert first.result == result
    assert type(again.result) is type(result)
    assert again.result == result
    assert (again.status, len(runs)) == (idemq.Status.DUPLICATE, 1)


def test_a_result_of_another_type_is_refused_before_anything_is_stored(store, clock):
    guard = idemq.Idempotency(
        store, consumer=unique("c"), mode="lease", clock=clock, codec=DataclassCodec(Receipt)
    )
    with pytest.raises(idemq.ResultNotSerializableError):
        guard.process("M1", lambda _tx: {"not": "a receipt"})
    # Released, not completed: the message can run again.
    assert guard.process("M1", lambda _tx: Receipt("o1", 1)).status is idemq.Status.PROCESSED


def test_a_typed_result_in_the_dedup_transaction(sql_store):
    guard = idemq.Idempotency(sql_store, consumer=unique("c"), codec=DataclassCodec(Receipt))
    assert guard.process("M1", lambda _tx: Receipt("o1", 5)).result == Receipt("o1", 5)
    assert guard.process("M1", lambda _tx: Receipt("never", 0)).result == Receipt("o1", 5)


def test_a_waiting_duplicate_gets_the_first_deliverys_result(store):
    # Real clock: the duplicate waits in real time for the holder, in another thread.
    consumer = unique("c")
    holder = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30)
    waiter = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30, wait_s=10)
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def slow(_tx: Any) -> dict[str, str]:
        runs.append("holder")
        started.set()
        assert release.wait(10)
        return {"shipped": "o1"}

    first = threading.Thread(target=holder.process, args=("M1", slow))
    first.start()
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    began = time.monotonic()
    duplicate = waiter.process("M1", lambda _tx: runs.append("waiter"))
    first.join(10)
    assert duplicate.status is idemq.Status.DUPLICATE
    assert duplicate.result == {"shipped": "o1"}
    assert runs == ["holder"]
    assert time.monotonic() - began >= 0.25


def test_a_waiting_duplicate_gives_up_in_progress_when_the_wait_runs_out(store):
    consumer = unique("c")  # both on the real clock: they judge the lease alike
    holder = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30)
    started, stuck = threading.Event(), threading.Event()

    def never_done(_tx: Any) -> None:
        started.set()
        stuck.wait(5)

    thread = threading.Thread(target=holder.process, args=("M1", never_done))
    thread.start()
    assert started.wait(10)
    try:
        waiter = idemq.Idempotency(store, consumer=consumer, mode="lease", wait_s=0.2)
        began = time.monotonic()
        outcome = waiter.process("M1", lambda _tx: pytest.fail("ran beside a live claim"))
        assert outcome.status is idemq.Status.IN_PROGRESS
        assert 0.15 <= time.monotonic() - began < 3
    finally:
        stuck.set()
        thread.join(10)


def test_the_local_cache_answers_duplicates_without_a_claim(store, clock):
    counting = Counting(store)
    guard = idemq.Idempotency(
        counting, consumer=unique("c"), mode="lease", clock=clock, local_cache=100
    )
    runs = []
    guard.process("M1", lambda _tx: runs.append(1) or {"n": 1})
    claims_after_first = counting.claims
    for _ in range(5):
        duplicate = guard.process("M1", lambda _tx: runs.append(1))
        assert (duplicate.status, duplicate.result) == (idemq.Status.DUPLICATE, {"n": 1})
    assert counting.claims == claims_after_first  # no store round trip for the duplicates
    assert len(runs) == 1


def test_the_local_cache_still_checks_the_payload(store, clock):
    guard = idemq.Idempotency(
        store, consumer=unique("c"), mode="lease", clock=clock, local_cache=10
    )
    guard.process("M1", lambda _tx: None, payload=b"first")
    with pytest.raises(idemq.PayloadMismatchError):
        guard.process("M1", lambda _tx: None, payload=b"another message")


def test_the_local_cache_never_holds_a_live_claim_nor_another_consumers_record(store, clock):
    first = idemq.Idempotency(
        store, consumer=unique("a"), mode="lease", clock=clock, local_cache=10
    )
    other = idemq.Idempotency(
        store, consumer=unique("b"), mode="lease", clock=clock, local_cache=10
    )
    first.process("M1", lambda _tx: 1)
    runs = []
    assert other.process("M1", lambda _tx: runs.append(1) or 2).status is idemq.Status.PROCESSED
    assert runs == [1]  # the same id for another consumer is another message
    assert first.cache is not None
    assert len(first.cache) == 1


def test_entries_expire_on_the_guards_clock(store):
    clock = FakeClock()
    counting = Counting(store)
    guard = idemq.Idempotency(
        counting,
        consumer=unique("c"),
        mode="lease",
        clock=clock,
        local_cache=10,
        local_cache_ttl_s=60,
    )
    guard.process("M1", lambda _tx: 1)
    guard.process("M1", lambda _tx: 1)
    claims = counting.claims
    clock.advance(61_000)
    assert guard.process("M1", lambda _tx: 1).status is idemq.Status.DUPLICATE
    assert counting.claims == claims + 1  # expired from the cache: asked the store again


def test_an_effect_in_the_callers_rolled_back_transaction_is_never_cached(sql_store):
    guard = idemq.Idempotency(sql_store, consumer=unique("c"), local_cache=10)
    runs = []
    with sql_store.engine.connect() as conn:
        trans = conn.begin()
        guard.process("M1", lambda _tx: runs.append(1), connection=conn)
        trans.rollback()  # the caller changed their mind: nothing of it committed
    assert guard.process("M1", lambda _tx: runs.append(1)).status is idemq.Status.PROCESSED
    assert runs == [1, 1]
    with sql_store.engine.connect() as conn:
        rows = conn.execute(sa.select(sa.func.count()).select_from(sql_store.table)).scalar()
    assert rows == 1


async def _async_lease_store(kind: str, tmp_path: Any) -> Any:
    if kind == "redis":
        require_service("redis")
        return idemq.AsyncRedisStore(REDIS_URL, prefix=unique("idemqtest"))
    store = idemq.AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    await store.create_schema()
    return store


async def _dispose_async(store: Any) -> None:
    if isinstance(store, idemq.AsyncRedisStore):
        redis_cleanup(store.prefix)
    await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_waiter_behind_a_call_that_gave_up_in_progress_is_never_answered_duplicate(
    kind: str, tmp_path: Any
):
    # Another worker holds M1's live lease all along. The first call waits wait_s and gives up
    # IN_PROGRESS; a second call of M1 on the same guard waits on the first (in-process). Nobody
    # completed M1, so the second must not be answered DUPLICATE: its worker would ack a
    # message whose effect never happened.
    consumer = unique("c")
    runs: list[int] = []

    async def main() -> tuple[idemq.Outcome[Any], idemq.Outcome[Any]]:
        store = await _async_lease_store(kind, tmp_path)
        try:
            foreign = ClaimRequest(
                Key(consumer, "M1"), None, None, "f" * 32, round(time.time() * 1000), 60_000
            )
            assert (await store.claim(foreign)).acquired
            guard = idemq.AsyncIdempotency(
                store, consumer=consumer, mode="lease", lease_s=60, wait_s=0.5
            )
            first = asyncio.create_task(guard.process("M1", lambda _tx: runs.append(1)))
            await asyncio.sleep(0.1)  # the first call is waiting for the foreign lease
            second = await guard.process("M1", lambda _tx: runs.append(2))
            return await first, second
        finally:
            await _dispose_async(store)

    first, second = asyncio.run(main())
    assert runs == []
    assert first.status is idemq.Status.IN_PROGRESS
    assert second.status is idemq.Status.IN_PROGRESS
    assert not second.should_ack


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_an_async_forget_drops_the_local_cache_entry_so_the_message_runs_again(
    kind: str, tmp_path: Any
):
    consumer = unique("c")
    runs: list[int] = []

    async def main() -> list[idemq.Status]:
        store = await _async_lease_store(kind, tmp_path)
        try:
            guard = idemq.AsyncIdempotency(store, consumer=consumer, mode="lease", local_cache=10)
            statuses = [(await guard.process("M1", lambda _tx: runs.append(1))).status]
            statuses.append((await guard.process("M1", lambda _tx: runs.append(1))).status)
            assert await guard.forget("M1") is ForgetResult.FORGOTTEN
            statuses.append((await guard.process("M1", lambda _tx: runs.append(1))).status)
            return statuses
        finally:
            await _dispose_async(store)

    statuses = asyncio.run(main())
    assert statuses == [idemq.Status.PROCESSED, idemq.Status.DUPLICATE, idemq.Status.PROCESSED]
    assert runs == [1, 1]  # forgotten: the effect happens again, as the operator asked
