"""The fencing token a won lease claim hands the handler (``current_message().fence``): strictly
increasing per message id across takeovers and release → reclaim on every store, and a stale
owner's fenced write is refused by ``versioned_update`` / ``StateMachine.apply``.

The business rows live in a SQLite file of the test's own: the fence comes from the dedup store,
whatever database the effect is written to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.guard.context import current_message
from idemq.stores.base import ClaimRequest, Key
from tests.contract.conftest import SQL_STORES, FakeClock, dispose, make_store

LEASE_MS = 30_000


def request(owner: str, clock: FakeClock, message_id: str = "M") -> ClaimRequest:
    return ClaimRequest(Key("fence", message_id), None, None, owner * 32, clock(), LEASE_MS)


def test_fences_increase_across_a_takeover_and_a_release(store, clock):
    first = store.claim(request("a", clock))
    assert first.acquired
    assert isinstance(first.fence, int)
    clock.advance(LEASE_MS)  # a's lease is over
    taken = store.claim(request("b", clock))
    assert taken.acquired
    assert taken.fence > first.fence
    store.release(Key("fence", "M"), "b" * 32)
    again = store.claim(request("c", clock))
    assert again.acquired
    assert again.fence > taken.fence
    lost = store.claim(request("d", clock))
    assert not lost.acquired
    assert lost.fence is None


@pytest.fixture(params=["postgres", "mariadb", "mysql-generic", "redis"])
def server_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = make_store(request.param, tmp_path, lease_clock="store")
    yield made
    dispose(made)


def test_fences_increase_on_the_stores_clock_too(server_store):
    """A real 50 ms lease on the store's clock, run out by a real wait."""
    fences = []
    for owner in "abc":
        claim = server_store.claim(ClaimRequest(Key("fence", "R"), None, None, owner * 32, 0, 50))
        assert claim.acquired
        fences.append(claim.fence)
        threading.Event().wait(0.12)
    assert fences == sorted(set(fences))
    assert len(fences) == 3


def accounts(path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{path / 'business.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INT, state TEXT, "
            "version INT, fence_token BIGINT)"
        )
        conn.exec_driver_sql("INSERT INTO accounts VALUES ('acc', 100, 'NEW', 1, NULL)")
    return engine


def stale_owner_then_takeover(
    store: Any,
    clock: FakeClock,
    first_write: Callable[[int], Any],
    late_write: Callable[[int], Any],
) -> tuple[int, int, Any]:
    """Owner A claims M, reads its fence and stalls past its lease; B takes M over and writes;
    then A wakes and makes its write. Returns (A's fence, B's fence, A's write's answer)."""
    old = idemq.Idempotency(store, consumer="fence", mode="lease", lease_s=30, clock=clock)
    new = idemq.Idempotency(store, consumer="fence", mode="lease", lease_s=30, clock=clock)
    stalled, resume = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def stale(_tx: Any) -> None:
        context = current_message()
        assert context is not None
        seen["a"] = context.fence
        stalled.set()
        resume.wait(10)
        seen["late"] = late_write(context.fence)

    def fresh(_tx: Any) -> None:
        context = current_message()
        assert context is not None
        seen["b"] = context.fence
        first_write(context.fence)

    def run_old() -> None:
        try:
            old.process("M", stale)
        except idemq.LeaseLostError:
            seen["lost"] = True

    holder = threading.Thread(target=run_old)
    holder.start()
    assert stalled.wait(10)
    clock.advance(LEASE_MS + 1)
    assert new.process("M", fresh).status is idemq.Status.PROCESSED
    resume.set()
    holder.join(10)
    assert seen["lost"]  # the old owner's complete is refused as well
    return seen["a"], seen["b"], seen["late"]


def test_a_stale_owners_versioned_update_is_refused(store, clock, tmp_path):
    engine = accounts(tmp_path)

    def credit(fence: int) -> bool:
        with engine.begin() as conn:
            balance, version = conn.exec_driver_sql(
                "SELECT balance, version FROM accounts WHERE id = 'acc'"
            ).one()
            return idemq.versioned_update(
                conn, "accounts", "id", "acc", version, {"balance": balance + 10}, fence=fence
            )

    fence_a, fence_b, late = stale_owner_then_takeover(store, clock, credit, credit)
    assert fence_b > fence_a
    assert late is False
    with engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT balance, fence_token FROM accounts").one()
        assert tuple(row) == (110, fence_b)  # one credit: the new owner's
        # Without the fence the stale write would have gone through (same version): the guard
        # that refused it is the fence, not the version check.
        version = conn.exec_driver_sql("SELECT version FROM accounts").scalar_one()
        assert idemq.versioned_update(conn, "accounts", "id", "acc", version, {"balance": 0})
        conn.rollback()
    engine.dispose()


def test_a_stale_owners_state_machine_transition_is_fenced(store, clock, tmp_path):
    """A stale "reserve" arrives after the new owner reserved and a later owner released: the
    transition is legal again (NEW → RESERVED), only the fence refuses it."""
    engine = accounts(tmp_path)
    machine = idemq.StateMachine(
        "accounts",
        "id",
        "state",
        states=["NEW", "RESERVED"],
        transitions={"reserve": ("NEW", "RESERVED"), "unreserve": ("RESERVED", "NEW")},
    )

    def reserve(fence: int) -> idemq.TransitionResult:
        with engine.begin() as conn:
            result = machine.apply(conn, "acc", "reserve", {"balance": 90}, fence=fence)
        if result is idemq.TransitionResult.APPLIED:
            # A later message's owner undoes the reservation (its claim fenced after B's).
            later = store.claim(request("e", clock, "UNRESERVE"))
            assert later.fence > fence
            with engine.begin() as conn:
                assert machine.apply(conn, "acc", "unreserve", fence=later.fence) is (
                    idemq.TransitionResult.APPLIED
                )
        return result

    fence_a, fence_b, late = stale_owner_then_takeover(store, clock, reserve, reserve)
    assert fence_b > fence_a
    assert late is idemq.TransitionResult.FENCED
    with engine.connect() as conn:
        assert tuple(conn.exec_driver_sql("SELECT state, balance FROM accounts").one()) == (
            "NEW",
            90,
        )
    engine.dispose()


@pytest.mark.parametrize("kind", SQL_STORES)
def test_transactional_mode_hands_no_fence(kind, tmp_path):
    store = make_store(kind, tmp_path)
    try:
        guard = idemq.Idempotency(store, consumer="fence")
        seen = []
        guard.process("T", lambda tx: seen.append(current_message().fence))  # type: ignore[union-attr]
        assert seen == [None]
    finally:
        dispose(store)
