"""The guard's contract in lease mode, run unchanged against every store.

Memory, SQLite, PostgreSQL, MariaDB (its one-statement claim and MySQL's portable plan) and Redis
must all behave the same: this file is the definition of "the same".
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import idemq
from idemq.stores.base import ClaimRequest, Key, RecordStatus
from tests.contract.conftest import FakeClock

LEASE_MS = 30_000


def lease_guard(store: Any, clock: FakeClock, consumer: str = "orders") -> idemq.Idempotency:
    return idemq.Idempotency(store, consumer=consumer, mode="lease", lease_s=30, clock=clock)


def foreign_claim(store: Any, clock: FakeClock, message_id: str, owner: str = "f" * 32) -> None:
    """Another worker claims ``message_id`` and is still running (or died holding the lease)."""
    request = ClaimRequest(Key("orders", message_id), None, None, owner, clock(), LEASE_MS)
    assert store.claim(request).acquired


class Calls:
    """A handler that counts its runs and returns a given value."""

    def __init__(self, value: Any = None) -> None:
        self.count = 0
        self.value = value

    def __call__(self, tx: Any) -> Any:
        self.count += 1
        return self.value


def test_first_delivery_runs_the_handler_and_a_duplicate_replays_its_result(store, clock):
    guard = lease_guard(store, clock)
    handler = Calls({"paid": True, "amount": 12.5})

    first = guard.process("ORDER_1", handler)
    second = guard.process("ORDER_1", handler)

    assert first.status is idemq.Status.PROCESSED
    assert first.result == {"paid": True, "amount": 12.5}
    assert second.status is idemq.Status.DUPLICATE
    assert second.result == {"paid": True, "amount": 12.5}
    assert handler.count == 1
    record = store.get("ORDER_1", "orders")
    assert record.status is RecordStatus.PROCESSED
    assert record.processed_time is not None


@pytest.mark.parametrize(
    "value", [None, 0, False, "", [], {}, 0.5, "ünïcødé ✓", [1, [2, {"x": None}]]]
)
def test_results_replay_faithfully(store, clock, value):
    guard = lease_guard(store, clock)
    guard.process("M", Calls(value))
    replay = guard.process("M", Calls("not this"))
    assert replay.status is idemq.Status.DUPLICATE
    assert replay.result == value
    assert type(replay.result) is type(value)


def test_handler_error_releases_the_claim_so_a_retry_runs(store, clock):
    guard = lease_guard(store, clock)

    def boom(tx: Any) -> None:
        raise RuntimeError("payment gateway down")

    with pytest.raises(RuntimeError, match="gateway down"):
        guard.process("M", boom)
    assert store.get("M", "orders") is None

    retry = guard.process("M", Calls("ok"))
    assert retry.status is idemq.Status.PROCESSED
    assert retry.result == "ok"


def test_unserializable_result_is_a_clear_error_and_releases(store, clock):
    guard = lease_guard(store, clock)
    with pytest.raises(idemq.ResultNotSerializableError):
        guard.process("M", Calls(object()))
    assert store.get("M", "orders") is None


def test_same_id_with_another_payload_is_refused(store, clock):
    guard = lease_guard(store, clock)
    guard.process("M", Calls(1), payload=b'{"amount": 10}')

    with pytest.raises(idemq.PayloadMismatchError) as info:
        guard.process("M", Calls(2), payload=b'{"amount": 99}')
    assert info.value.message_id == "M"
    assert guard.process("M", Calls(3), payload=b'{"amount": 10}').result == 1
    assert guard.process("M", Calls(4)).status is idemq.Status.DUPLICATE


def test_json_payloads_hash_canonically(store, clock):
    guard = lease_guard(store, clock)
    guard.process("M", Calls(1), payload={"a": 1, "b": [1, 2]})
    again = guard.process("M", Calls(2), payload={"b": [1, 2], "a": 1})
    assert again.status is idemq.Status.DUPLICATE


@pytest.mark.parametrize(
    "bad",
    ["", "x" * 129, 42, None, b"ORDER_1", "a\x00b", "\ud800"],
    ids=["empty", "129-chars", "int", "none", "bytes", "nul", "surrogate"],
)
def test_invalid_ids_raise_and_write_nothing(store, clock, bad):
    guard = lease_guard(store, clock)
    handler = Calls()
    with pytest.raises(idemq.InvalidMessageIdError):
        guard.process(bad, handler)
    assert handler.count == 0
    assert store.in_progress() == []


def test_ids_of_128_characters_are_fine(store, clock):
    guard = lease_guard(store, clock)
    assert guard.process("é" * 128, Calls()).status is idemq.Status.PROCESSED
    assert guard.process("é" * 128, Calls()).status is idemq.Status.DUPLICATE


@pytest.mark.parametrize(
    "pair", [("Case", "case"), ("pad", "pad "), ("é", "e\u0301"), ("a", "a\t")]
)
def test_keys_are_exact(store, clock, pair):
    guard = lease_guard(store, clock)
    first, second = pair
    assert guard.process(first, Calls()).status is idemq.Status.PROCESSED
    assert guard.process(second, Calls()).status is idemq.Status.PROCESSED
    assert store.get(first, "orders").message_id == first
    assert store.get(second, "orders").message_id == second


def test_keys_are_scoped_per_consumer(store, clock):
    billing = lease_guard(store, clock, consumer="billing")
    shipping = lease_guard(store, clock, consumer="shipping")
    assert billing.process("M", Calls()).status is idemq.Status.PROCESSED
    assert shipping.process("M", Calls()).status is idemq.Status.PROCESSED
    assert [r.consumer for r in store.find("M")] == ["billing", "shipping"]


def test_live_lease_is_in_progress_and_not_run(store, clock):
    foreign_claim(store, clock, "M")
    handler = Calls()
    clock.advance(LEASE_MS - 1)
    outcome = lease_guard(store, clock).process("M", handler)
    assert outcome.status is idemq.Status.IN_PROGRESS
    assert not outcome.should_ack
    assert handler.count == 0


def test_expired_lease_is_taken_over_and_the_old_owners_complete_is_refused(store, clock):
    foreign_claim(store, clock, "M", owner="a" * 32)
    clock.advance(LEASE_MS)
    taken = lease_guard(store, clock).process("M", Calls("new owner"))
    assert taken.status is idemq.Status.PROCESSED

    with pytest.raises(idemq.LeaseLostError):
        store.complete(Key("orders", "M"), "a" * 32, '"late"', clock())
    record = store.get("M", "orders")
    assert record.result == '"new owner"'
    assert record.attempts == 2


def test_a_late_complete_never_overwrites_a_new_owner_still_at_work(store, clock):
    # The old owner comes back while the new one is still running: its complete must be refused
    # and leave the new owner's claim as it was, so the new owner's result is the one kept.
    key = Key("orders", "M")
    foreign_claim(store, clock, "M", owner="a" * 32)
    clock.advance(LEASE_MS)
    taker = ClaimRequest(key, None, None, "b" * 32, clock(), LEASE_MS)
    assert store.claim(taker).acquired
    with pytest.raises(idemq.LeaseLostError):
        store.complete(key, "a" * 32, '"late"', clock())
    record = store.get("M", "orders")
    assert (record.status, record.owner, record.result) == (RecordStatus.PROCESSING, "b" * 32, None)
    store.complete(key, "b" * 32, '"new owner"', clock())
    assert lease_guard(store, clock).process("M", Calls()).result == "new owner"


def test_release_by_a_non_owner_does_nothing(store, clock):
    foreign_claim(store, clock, "M", owner="a" * 32)
    store.release(Key("orders", "M"), "b" * 32)
    assert store.get("M", "orders").owner == "a" * 32
    assert store.in_progress()[0].message_id == "M"


def test_business_id_is_stored_and_validated(store, clock):
    guard = lease_guard(store, clock)
    guard.process("M", Calls(), business_id="order_123")
    assert store.get("M", "orders").business_id == "order_123"
    with pytest.raises(idemq.InvalidBusinessIdError):
        guard.process("N", Calls(), business_id="x" * 65)


def test_purge_deletes_only_processed_records_older_than_the_cutoff(store, clock):
    guard = lease_guard(store, clock)
    for i in range(5):
        guard.process(f"old-{i}", Calls())
    foreign_claim(store, clock, "stuck")
    clock.advance(8 * 24 * 3600 * 1000)
    guard.process("fresh", Calls())

    deleted = store.purge(timedelta(days=7), batch_size=2, now_ms=clock())

    assert deleted == 5
    assert store.get("old-0", "orders") is None
    assert store.get("fresh", "orders") is not None
    assert store.get("stuck", "orders") is not None


def test_in_progress_lists_stuck_leases(store, clock):
    foreign_claim(store, clock, "stuck-1")
    lease_guard(store, clock).process("done", Calls())
    stuck = store.in_progress()
    assert [r.message_id for r in stuck] == ["stuck-1"]
    assert stuck[0].lease_expired(clock() + LEASE_MS)


def test_decorator_is_sugar_over_process(store, clock):
    guard = lease_guard(store, clock)
    runs: list[str] = []

    @guard.idempotent(key=lambda msg: msg["id"], payload=lambda msg: msg)
    def pay(msg: dict[str, Any]) -> str:
        runs.append(msg["id"])
        return f"paid {msg['id']}"

    assert pay({"id": "O1"}).result == "paid O1"
    assert pay({"id": "O1"}).status is idemq.Status.DUPLICATE
    with pytest.raises(idemq.InvalidMessageIdError):
        pay({"no-id": 1})
    assert runs == ["O1"]


def test_batch_keeps_order_and_isolates_failures(store, clock):
    guard = lease_guard(store, clock)
    guard.process("seen", Calls("before"))
    applied: list[str] = []

    def handle(msg: idemq.Message, tx: Any) -> str:
        if msg.id == "bad":
            raise ValueError("poison")
        applied.append(msg.id)
        return msg.id.upper()

    batch = [
        idemq.Message(id="a", body=b"1"),
        idemq.Message(id="seen", body=b"x"),
        idemq.Message(id="bad", body=b"2"),
        idemq.Message(id="a", body=b"1"),
        idemq.Message(id="", body=b"3"),
        idemq.Message(id="b", body=b"4"),
    ]
    outcomes = guard.process_batch(batch, handle)

    assert [o.status for o in outcomes] == [
        idemq.Status.PROCESSED,
        idemq.Status.DUPLICATE,
        idemq.Status.FAILED,
        idemq.Status.DUPLICATE,
        idemq.Status.FAILED,
        idemq.Status.PROCESSED,
    ]
    assert [o.result for o in outcomes] == ["A", "before", None, "A", None, "B"]
    assert isinstance(outcomes[2].error, ValueError)
    assert isinstance(outcomes[4].error, idemq.InvalidMessageIdError)
    assert sorted(applied) == ["a", "b"]
    assert store.get("bad", "orders") is None


def test_an_expired_lease_is_not_taken_over_by_another_payload(store, clock):
    request = ClaimRequest(Key("orders", "M"), None, "a" * 64, "f" * 32, clock(), LEASE_MS)
    assert store.claim(request).acquired
    clock.advance(LEASE_MS)
    guard = lease_guard(store, clock)
    with pytest.raises(idemq.PayloadMismatchError):
        guard.process("M", Calls(), payload=b"another message under the same id")
    assert store.get("M", "orders").owner == "f" * 32
    assert guard.process("M", Calls("same")).status is idemq.Status.PROCESSED  # no payload given


@pytest.mark.parametrize("result", ["\udcff", {"k": "a\ud800b", "ok": "ü"}, ["\udfff"]])
def test_a_result_with_a_lone_surrogate_is_stored_and_replayed_exactly(store, clock, result):
    guard = lease_guard(store, clock)
    assert guard.process("M", Calls(result)).result == result
    assert guard.process("M", Calls("never")).result == result


def test_a_business_id_with_a_lone_surrogate_is_refused_before_anything_runs(store, clock):
    handler = Calls()
    with pytest.raises(idemq.InvalidBusinessIdError):
        lease_guard(store, clock).process("M", handler, business_id="order\udcff")
    assert handler.count == 0
    assert store.get("M", "orders") is None


def test_a_renewal_by_a_worker_whose_lease_was_taken_over_is_refused_and_extends_nothing(
    store, clock
):
    # The owner check is the whole point of renew: without it the stale worker's renewal would
    # answer "still yours" and push the new owner's lease out, and the stale worker would go on
    # to its effect unwarned.
    key = Key("orders", "M1")
    stale, current = "a" * 32, "b" * 32
    assert store.claim(ClaimRequest(key, None, None, stale, clock(), LEASE_MS)).acquired
    clock.advance(LEASE_MS + 1)
    assert store.claim(ClaimRequest(key, None, None, current, clock(), LEASE_MS)).acquired
    before = store.get("M1", "orders")

    assert store.renew(key, stale, clock() + 10 * LEASE_MS, clock()) is False

    after = store.get("M1", "orders")
    assert after.owner == current
    assert after.lease_until_ms == before.lease_until_ms  # the new owner's lease untouched
    assert store.renew(key, current, clock() + 2 * LEASE_MS, clock()) is True
    assert store.get("M1", "orders").lease_until_ms == clock() + 2 * LEASE_MS
