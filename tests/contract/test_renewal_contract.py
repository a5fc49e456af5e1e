"""Lease renewal on every store: a handler longer than its lease keeps it, and one whose lease
was lost anyway is told, and cannot complete.

Real time: renewal is a thread (or task) racing the handler and a would-be taker, which is the
point. Leases are 1.5 s and handlers 3-4 s, so each handler outlives its lease twice over while
a renewal every 0.5 s keeps it, with room for a loaded machine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idemq
from idemq.guard.context import current_message
from idemq.stores.base import ClaimRequest, ForgetResult, Key, RecordStatus
from tests.conftest import REDIS_URL, require_service, unique
from tests.contract.conftest import FakeClock, dispose, make_store

LEASE_S = 1.5


def guard_of(store: Any, consumer: str, **options: Any) -> idemq.Idempotency:
    return idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S, **options)


@pytest.mark.slow
def test_a_handler_longer_than_its_lease_keeps_it_and_runs_once(store):
    consumer = unique("c")
    holder, rival = guard_of(store, consumer), guard_of(store, consumer)
    runs: list[str] = []
    started = threading.Event()

    def slow(_tx: Any) -> str:
        runs.append("holder")
        started.set()
        time.sleep(2.5 * LEASE_S)
        return "done"

    first: list[idemq.Outcome[Any]] = []
    thread = threading.Thread(target=lambda: first.append(holder.process("M1", slow)))
    thread.start()
    assert started.wait(10)
    time.sleep(1.5 * LEASE_S)  # past the first lease: without renewal it would be taken over
    rival_outcome = rival.process("M1", lambda _tx: runs.append("rival"))
    thread.join(20)
    assert rival_outcome.status is idemq.Status.IN_PROGRESS
    assert first[0].status is idemq.Status.PROCESSED
    assert runs == ["holder"]


@pytest.mark.slow
def test_without_renewal_the_same_handler_is_taken_over(store):
    # The control: what renewal prevents really happens without it.
    consumer = unique("c")
    holder, rival = guard_of(store, consumer, renew=False), guard_of(store, consumer)
    runs: list[str] = []
    started = threading.Event()
    errors: list[BaseException] = []

    def slow(_tx: Any) -> None:
        runs.append("holder")
        started.set()
        time.sleep(2 * LEASE_S)

    def run() -> None:
        try:
            holder.process("M1", slow)
        except idemq.LeaseLostError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(10)
    time.sleep(1.3 * LEASE_S)
    assert rival.process("M1", lambda _tx: runs.append("rival")).status is idemq.Status.PROCESSED
    thread.join(20)
    assert runs == ["holder", "rival"]  # two effects: the reason renewal exists
    assert len(errors) == 1  # and the late complete was refused


def test_a_handler_whose_lease_is_lost_is_told_and_cannot_complete(store):
    consumer = unique("c")
    guard = guard_of(store, consumer)
    seen: list[bool] = []

    def handler(_tx: Any) -> None:
        context = current_message()
        assert context is not None
        # An operator (or a takeover) removes the claim while the handler runs.
        assert store.forget("M1", consumer, force=True) is ForgetResult.FORGOTTEN
        seen.append(context.wait_lease_lost(3 * LEASE_S))

    with pytest.raises(idemq.LeaseLostError):
        guard.process("M1", handler)
    assert seen == [True]
    assert store.get("M1", consumer) is None  # nothing completed over the gap


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_an_async_handler_whose_lease_is_lost_is_cancelled(kind: str, tmp_path: Any):
    consumer = unique("c")
    reached: list[str] = []

    async def main() -> None:
        store = await async_lease_store(kind, tmp_path)
        guard = idemq.AsyncIdempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S)

        async def handler(_tx: Any) -> None:
            await store.forget("M1", consumer, force=True)
            try:
                await asyncio.sleep(5 * LEASE_S)
            except asyncio.CancelledError:
                reached.append("cancelled")
                raise
            reached.append("finished")  # never: no effect after a lost lease

        try:
            with pytest.raises(idemq.LeaseLostError):
                await guard.process("M1", handler)
        finally:
            await store.close()

    began = time.monotonic()
    asyncio.run(main())
    assert reached == ["cancelled"]
    assert time.monotonic() - began < 4 * LEASE_S


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_lost_lease_leaves_the_callers_task_uncancelled(kind: str, tmp_path: Any):
    # The handler runs in the caller's task, which the renewal cancels when the lease is lost;
    # once that is a LeaseLostError, the task must not stay "cancelling" (a timeout or task
    # group around the call would take the renewal's cancel for its own).
    consumer = unique("c")

    async def main() -> tuple[int, bool]:
        store = await async_lease_store(kind, tmp_path)
        guard = idemq.AsyncIdempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S)

        async def handler(_tx: Any) -> None:
            await store.forget("M1", consumer, force=True)
            await asyncio.sleep(5 * LEASE_S)

        try:
            async with asyncio.timeout(10 * LEASE_S) as scope:
                with pytest.raises(idemq.LeaseLostError):
                    await guard.process("M1", handler)
                await asyncio.sleep(0.01)  # still runs: nothing left to cancel this task
            task = asyncio.current_task()
            assert task is not None
            return task.cancelling(), scope.expired()
        finally:
            await store.close()

    assert asyncio.run(main()) == (0, False)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_cancelled_caller_cancels_its_async_handler_and_releases_the_claim(
    kind: str, tmp_path: Any
):
    consumer = unique("c")
    reached: list[str] = []

    async def main() -> Any:
        store = await async_lease_store(kind, tmp_path)
        guard = idemq.AsyncIdempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S)

        async def handler(_tx: Any) -> None:
            try:
                await asyncio.sleep(5 * LEASE_S)
            except asyncio.CancelledError:
                reached.append("cancelled")
                raise

        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await guard.process("M1", handler)
            return await store.get("M1", consumer)
        finally:
            await store.close()

    assert asyncio.run(main()) is None  # released: the message can run again at once
    assert reached == ["cancelled"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_an_async_handler_longer_than_its_lease_keeps_it_and_runs_once(kind: str, tmp_path: Any):
    # The renewal task starts only when the first renewal is due (a timer until then): the
    # claim must still be renewed from then on, every interval, past two leases.
    consumer = unique("c")
    runs: list[str] = []

    async def main() -> tuple[idemq.Outcome[Any], idemq.Outcome[Any]]:
        store = await async_lease_store(kind, tmp_path)
        holder = idemq.AsyncIdempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S)
        rival = idemq.AsyncIdempotency(store, consumer=consumer, mode="lease", lease_s=LEASE_S)
        started = asyncio.Event()

        async def slow(_tx: Any) -> str:
            runs.append("holder")
            started.set()
            await asyncio.sleep(2.5 * LEASE_S)
            return "done"

        async def rival_later() -> idemq.Outcome[Any]:
            await started.wait()
            await asyncio.sleep(1.5 * LEASE_S)  # past the first lease
            return await rival.process("M1", lambda _tx: runs.append("rival"))

        try:
            first, second = await asyncio.gather(holder.process("M1", slow), rival_later())
        finally:
            await store.close()
        return first, second

    first, second = asyncio.run(main())
    assert second.status is idemq.Status.IN_PROGRESS
    assert first.status is idemq.Status.PROCESSED
    assert runs == ["holder"]


async def async_lease_store(kind: str, tmp_path: Any) -> Any:
    if kind == "redis":
        require_service("redis")
        return idemq.AsyncRedisStore(REDIS_URL, prefix=unique("idemqtest"))
    store = idemq.AsyncSqlStore(f"sqlite:///{tmp_path / 'idemq.db'}", table=unique("mi"))
    await store.create_schema()
    return store


@pytest.fixture(params=["redis", "postgres"])
def redis_or_pg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = make_store(request.param, tmp_path)
    yield made
    dispose(made)


@pytest.mark.slow
def test_a_3s_handler_with_a_1s_lease_runs_once_while_duplicates_keep_arriving(redis_or_pg):
    # Another worker keeps delivering the message the whole time the handler runs: each
    # delivery meets the renewed claim (IN_PROGRESS), none takes it over, and the ones after
    # the handler finished replay its result.
    store, consumer = redis_or_pg, unique("c")
    holder = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=1)
    rival = idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=1)
    runs: list[str] = []
    started = threading.Event()

    def slow(_tx: Any) -> str:
        runs.append("holder")
        started.set()
        time.sleep(3)
        return "done"

    first: list[idemq.Outcome[Any]] = []
    thread = threading.Thread(target=lambda: first.append(holder.process("M1", slow)))
    thread.start()
    assert started.wait(10)
    answers: list[idemq.Status] = []
    while thread.is_alive():
        outcome = rival.process("M1", lambda _tx: runs.append("rival"))
        answers.append(outcome.status)
        time.sleep(0.05)
    thread.join(20)
    after = rival.process("M1", lambda _tx: runs.append("rival"))
    assert first[0].status is idemq.Status.PROCESSED
    assert runs == ["holder"]
    assert answers.count(idemq.Status.IN_PROGRESS) >= 20  # deliveries all through the 3 s
    assert set(answers) <= {idemq.Status.IN_PROGRESS, idemq.Status.DUPLICATE}
    assert after.status is idemq.Status.DUPLICATE
    assert after.result == "done"


def test_a_handler_whose_lease_was_taken_over_is_told_by_its_next_renewal(store):
    # A rival takes the claim over (the lease ran out on the guard's clock) and is still at
    # work: the holder's next renewal is refused by the owner check and its handler hears of
    # it; the rival's lease is left as the rival made it.
    clock = FakeClock()
    consumer = unique("c")
    holder = guard_of(store, consumer, clock=clock)
    key, rival = Key(consumer, "M1"), "f" * 32
    lease_ms = round(LEASE_S * 1000)
    seen: list[bool] = []

    def handler(_tx: Any) -> None:
        context = current_message()
        assert context is not None
        for _ in range(5):  # a renewal landing between the two lines would keep it: again
            clock.advance(lease_ms + 1)
            if store.claim(ClaimRequest(key, None, None, rival, clock(), lease_ms)).acquired:
                break
        seen.append(context.wait_lease_lost(3 * LEASE_S))

    with pytest.raises(idemq.LeaseLostError):
        holder.process("M1", handler)
    assert seen == [True]
    record = store.get("M1", consumer)
    assert record.owner == rival
    assert record.status is RecordStatus.PROCESSING
    assert record.lease_until_ms == clock() + lease_ms  # not pushed out by the stale holder
