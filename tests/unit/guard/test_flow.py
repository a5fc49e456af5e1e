"""The I/O-free flow of one message: which steps it asks for, and what a failure leads to.

The contract suite runs the same flow through the sync and async guards on every store; these
tests drive it by hand, so each decision is pinned without a database.
"""

from __future__ import annotations

from typing import Any

import pytest

import idemq
from idemq.guard import flow as steps
from idemq.guard.core import CLAIM_ATTEMPTS, Policy, Status
from idemq.guard.flow import ConflictRetries, message_flow
from idemq.stores.base import Claim, Record, RecordStatus


def flow_of(mode: str, message_id: str = "m1", payload: object = None):
    policy = Policy.build(consumer="c", mode=mode, lease_s=30.0, clock=lambda: 1_000)
    return message_flow(policy, policy.request(message_id, None, payload), None)


def run(
    flow, claim: Claim, handler_reply: tuple[bool, Any], fail: type[BaseException] | None = None
):
    """Answer every step; ``fail``: the store step that raises (by step class name)."""
    trail: list[str] = []
    reply: Any = None
    throw: BaseException | None = None
    while True:
        try:
            step = flow.throw(throw) if throw is not None else flow.send(reply)
        except StopIteration as stop:
            return trail, stop.value
        throw, reply = None, None
        trail.append(type(step).__name__)
        if isinstance(step, steps.Claim | steps.ClaimIn):
            reply = claim
        elif isinstance(step, steps.RunHandler):
            reply = handler_reply
        elif fail is not None and type(step).__name__ == fail.__name__:
            throw = idemq.StoreUnavailableError("store down")


def processed_record(result: str = '"first"') -> Claim:
    return Claim.lost_to(Record("c", "m1", RecordStatus.PROCESSED, result=result))


def test_lease_mode_claims_runs_and_completes():
    trail, outcome = run(flow_of("lease"), Claim.won(), (True, {"n": 1}))
    assert trail == ["Claim", "RunHandler", "Complete"]
    assert (outcome.status, outcome.result) == (Status.PROCESSED, {"n": 1})


def test_transactional_mode_confirms_the_row_with_its_result_before_the_commit():
    trail, outcome = run(flow_of("transactional"), Claim.won(), (True, 0))
    assert trail == ["ClaimIn", "RunHandler", "ConfirmIn"]
    assert outcome.result == 0


def test_a_none_result_is_confirmed_too():
    # The row already holds null, but only the confirmation proves the transaction still holds
    # the row: a handler may have caught an error that aborted or rolled it back.
    trail, _ = run(flow_of("transactional"), Claim.won(), (True, None))
    assert trail == ["ClaimIn", "RunHandler", "ConfirmIn"]


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_duplicate_replays_the_stored_result_without_running(mode: str):
    trail, outcome = run(flow_of(mode), processed_record(), (True, "never"))
    assert trail == ["ClaimIn" if mode == "transactional" else "Claim"]
    assert (outcome.status, outcome.result) == (Status.DUPLICATE, "first")


def test_a_live_lease_is_in_progress():
    live = Record("c", "m1", RecordStatus.PROCESSING, owner="other", lease_until_ms=10**13)
    _, outcome = run(flow_of("lease"), Claim.lost_to(live), (True, "never"))
    assert outcome.status is Status.IN_PROGRESS


def test_a_lease_handler_failure_releases_then_raises():
    boom = ValueError("boom")
    flow = flow_of("lease")
    assert isinstance(next(flow), steps.Claim)
    assert isinstance(flow.send(Claim.won()), steps.RunHandler)
    assert isinstance(flow.send((False, boom)), steps.Release)
    with pytest.raises(ValueError, match="boom") as raised:
        flow.send(None)
    assert raised.value is boom


def test_a_failed_release_is_noted_on_the_handlers_error():
    boom = ValueError("boom")
    flow = flow_of("lease")
    next(flow)
    flow.send(Claim.won())
    flow.send((False, boom))
    with pytest.raises(ValueError, match="boom"):
        flow.throw(idemq.StoreUnavailableError("redis down"))
    assert any("releasing the claim failed too" in note for note in boom.__notes__)


def test_a_transactional_handler_failure_raises_for_the_rollback():
    boom = KeyboardInterrupt()
    flow = flow_of("transactional")
    next(flow)
    flow.send(Claim.won())
    with pytest.raises(KeyboardInterrupt):
        flow.send((False, boom))  # nothing to undo by hand: the shell's transaction rolls back


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_an_unstorable_result_fails_the_message_before_anything_is_written(mode: str):
    flow = flow_of(mode)
    next(flow)
    flow.send(Claim.won())
    if mode == "lease":
        assert isinstance(flow.send((True, {1, 2})), steps.Release)
        with pytest.raises(idemq.ResultNotSerializableError):
            flow.send(None)
    else:
        with pytest.raises(idemq.ResultNotSerializableError):
            flow.send((True, {1, 2}))


def test_a_payload_mismatch_raises_at_the_claim():
    record = Record("c", "m1", RecordStatus.PROCESSED, payload_hash="other", result="null")
    flow = flow_of("lease", payload=b"body")
    next(flow)
    with pytest.raises(idemq.PayloadMismatchError):
        flow.send(Claim.lost_to(record))


def test_a_lost_lease_at_complete_goes_to_the_caller():
    flow = flow_of("lease")
    next(flow)
    flow.send(Claim.won())
    assert isinstance(flow.send((True, 1)), steps.Complete)
    with pytest.raises(idemq.LeaseLostError):
        flow.throw(idemq.LeaseLostError("taken over"))


def test_a_deadlocked_transaction_of_idemqs_runs_again_a_bounded_number_of_times():
    retries = ConflictRetries(owns_transaction=True)
    runs = 1
    while retries.again(idemq.StoreConflictError("deadlock")):
        runs += 1
    assert runs == CLAIM_ATTEMPTS


def test_a_deadlock_in_the_callers_transaction_is_the_callers_to_retry():
    retries = ConflictRetries(owns_transaction=False)
    assert not retries.again(idemq.StoreConflictError("deadlock"))
    assert not ConflictRetries(owns_transaction=True).again(ValueError("not a conflict"))


def test_a_lease_claim_that_keeps_conflicting_is_in_progress_not_an_error():
    # The store reran its claim transaction until its attempts ran out, each rolled back by a
    # concurrent one on the same record: nothing is written, the message is not acked, and it
    # is not the handler's failure either.
    flow = flow_of("lease")
    assert isinstance(next(flow), steps.Claim)
    with pytest.raises(StopIteration) as stop:
        flow.throw(idemq.StoreConflictError("deadlock"))
    outcome = stop.value.value
    assert outcome.status is Status.IN_PROGRESS
    assert not outcome.should_ack


def test_a_transactional_claim_conflict_goes_to_the_retries():
    flow = flow_of("transactional")
    assert isinstance(next(flow), steps.ClaimIn)
    with pytest.raises(idemq.StoreConflictError):
        flow.throw(idemq.StoreConflictError("deadlock"))


def test_a_waiting_duplicate_whose_claim_conflicts_keeps_waiting():
    now = [1_000]
    policy = Policy.build(
        consumer="c", mode="lease", lease_s=30.0, clock=lambda: now[0], wait_s=1.0
    )
    flow = message_flow(policy, policy.request("m1"), None)
    assert isinstance(next(flow), steps.Claim)
    held = Record("c", "m1", RecordStatus.PROCESSING, owner="other", lease_until_ms=60_000)
    assert isinstance(flow.send(Claim.lost_to(held)), steps.Pause)
    assert isinstance(flow.send(None), steps.Claim)
    assert isinstance(flow.throw(idemq.StoreConflictError("deadlock")), steps.Pause)
    assert isinstance(flow.send(None), steps.Claim)
    done = Record("c", "m1", RecordStatus.PROCESSED, result='"r"')
    with pytest.raises(StopIteration) as stop:
        flow.send(Claim.lost_to(done))
    assert (stop.value.value.status, stop.value.value.result) == (Status.DUPLICATE, "r")
