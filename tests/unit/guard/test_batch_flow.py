"""The I/O-free flow of ``process_batch``: which steps it asks for, and when a pass runs again.

The contract suite runs the same flow through the sync and async guards on every store; these
tests drive it by hand, so each decision is pinned without a database.
"""

from __future__ import annotations

from typing import Any

import pytest

import idemq
from idemq.guard import flow as steps
from idemq.guard.batch_flow import BatchPasses, HandlerFailedError, batch_flow, plan_batch
from idemq.guard.core import CLAIM_ATTEMPTS, Policy, Status
from idemq.stores.base import Claim, Record, RecordStatus


def policy_of(mode: str = "lease") -> Policy:
    return Policy.build(consumer="c", mode=mode, lease_s=30.0, clock=lambda: 1_000)


def plan_of(*ids: str, mode: str = "lease"):
    policy = policy_of(mode)
    messages = [idemq.Message(id=i, body=b"{}") for i in ids]
    return policy, plan_batch(policy, messages), messages


def flow_of(*ids: str, mode: str = "lease", **kw: Any):
    policy, plan, messages = plan_of(*ids, mode=mode)
    return batch_flow(policy, plan, messages, **kw)


def drive(flow, claims: list[Claim], replies: dict[str, tuple[bool, Any]]):
    """Answer the flow's steps; returns (claimed ids, handled ids, outcomes)."""
    claimed, handled, outcomes, _trail = drive_trail(flow, claims, replies)
    return claimed, handled, outcomes


def drive_trail(flow, claims: list[Claim], replies: dict[str, tuple[bool, Any]]):
    """Like :func:`drive`, and the names of every step asked for, in order."""
    claimed: list[str] = []
    handled: list[str] = []
    trail: list[str] = []
    reply: Any = None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            return claimed, handled, stop.value, trail
        trail.append(type(step).__name__)
        reply = None
        if isinstance(step, steps.ClaimMany | steps.ClaimManyIn):
            claimed = [r.key.message_id for r in step.requests]
            reply = claims[: len(step.requests)]
        elif isinstance(step, steps.RunHandler):
            handled.append(step.message.id)
            reply = replies[step.message.id]
        elif isinstance(step, steps.OpenSavepoint):
            reply = "savepoint"


def done(message_id: str, payload_hash: str | None = None) -> Claim:
    return Claim.lost_to(
        Record("c", message_id, RecordStatus.PROCESSED, payload_hash=payload_hash, result='"old"')
    )


def test_new_messages_are_handled_and_duplicates_replayed_without_running():
    boom = ValueError("boom")
    claimed, handled, outcomes = drive(
        flow_of("a", "b", "c", isolated=True),
        [Claim.won(), done("b"), Claim.won()],
        {"a": (True, 1), "c": (False, boom)},
    )
    assert claimed == ["a", "b", "c"]
    assert handled == ["a", "c"]  # b was processed before: its handler does not run
    assert [(o.status, o.result) for o in outcomes] == [
        (Status.PROCESSED, 1),
        (Status.DUPLICATE, "old"),
        (Status.FAILED, None),
    ]
    assert outcomes[2].error is boom


def test_a_raising_handler_ends_an_optimistic_pass():
    boom = ValueError("boom")
    with pytest.raises(HandlerFailedError) as caught:
        drive(
            flow_of("a", "b", "c", mode="transactional", isolated=False),
            [Claim.won()] * 3,
            {"a": (True, None), "b": (False, boom)},
        )
    assert (caught.value.index, caught.value.error) == (1, boom)


def test_an_isolated_pass_neither_claims_nor_reruns_the_message_that_failed():
    boom = ValueError("boom")
    claimed, handled, outcomes = drive(
        flow_of("a", "b", "c", mode="transactional", isolated=True, failures={1: boom}),
        [Claim.won(), Claim.won()],
        {"a": (True, None), "c": (True, None)},
    )
    assert claimed == handled == ["a", "c"]
    assert [o.status for o in outcomes] == [Status.PROCESSED, Status.FAILED, Status.PROCESSED]
    assert outcomes[1].error is boom


def test_a_payload_mismatch_fails_only_its_message():
    _claimed, handled, outcomes = drive(
        flow_of("a", "b", mode="transactional", isolated=False),
        [done("a", payload_hash="another body"), Claim.won()],
        {"b": (True, None)},
    )
    assert handled == ["b"]
    assert isinstance(outcomes[0].error, idemq.PayloadMismatchError)
    assert outcomes[1].status is Status.PROCESSED


def test_a_batch_with_nothing_to_claim_asks_for_nothing():
    boom = ValueError("boom")
    claimed, handled, outcomes = drive(
        flow_of("a", mode="transactional", isolated=True, failures={0: boom}), [], {}
    )
    assert (claimed, handled) == ([], [])
    assert outcomes[0].error is boom


def test_an_optimistic_pass_runs_handlers_without_savepoints():
    _claimed, _handled, _outcomes, trail = drive_trail(
        flow_of("a", "b", mode="transactional", isolated=False),
        [Claim.won(), Claim.won()],
        {"a": (True, {"r": 1}), "b": (True, None)},
    )
    # Each row is confirmed as its handler returns (the store makes only free checks then),
    # and the batch's rows all at once before the commit.
    assert trail == [
        "ClaimManyIn", "RunHandler", "ConfirmIn", "RunHandler", "ConfirmIn", "ConfirmManyIn"
    ]  # fmt: skip


def test_an_isolated_pass_undoes_a_failed_message_and_keeps_the_others():
    _claimed, _handled, outcomes, trail = drive_trail(
        flow_of("a", "b", mode="transactional", isolated=True),
        [Claim.won(), Claim.won()],
        {"a": (False, ValueError("boom")), "b": (True, None)},
    )
    assert trail == [
        "ClaimManyIn",
        "OpenSavepoint", "RunHandler", "HandlerFailureIn", "CloseSavepoint", "ReleaseIn",
        "OpenSavepoint", "RunHandler", "ConfirmIn", "CloseSavepoint",
        "ConfirmManyIn",
    ]  # fmt: skip
    assert [o.status for o in outcomes] == [Status.FAILED, Status.PROCESSED]


def test_a_store_error_in_an_isolated_pass_fails_the_pass_not_the_message():
    # A rollback to savepoint that fails means the transaction is gone (InnoDB rolls it back
    # whole on a deadlock): carrying on would answer PROCESSED for effects never committed.
    flow = flow_of("a", "b", mode="transactional", isolated=True)
    assert isinstance(next(flow), steps.ClaimManyIn)
    assert isinstance(flow.send([Claim.won(), Claim.won()]), steps.OpenSavepoint)
    assert isinstance(flow.send("savepoint"), steps.RunHandler)
    ask = flow.send((False, ValueError("the handler's own error")))
    assert isinstance(ask, steps.HandlerFailureIn)
    close = flow.send(None)  # the store says: not a lost transaction
    assert isinstance(close, steps.CloseSavepoint)
    assert not close.commit
    gone = idemq.StoreConflictError("SAVEPOINT does not exist")
    with pytest.raises(idemq.StoreConflictError):
        flow.throw(gone)


@pytest.mark.parametrize("isolated", [False, True])
def test_a_handler_error_that_means_the_transaction_is_gone_fails_the_pass(isolated: bool):
    # InnoDB rolls the whole transaction back on a deadlock inside a handler's statement:
    # neither the other messages' writes nor this one's claim exist any more.
    flow = flow_of("a", "b", mode="transactional", isolated=isolated)
    next(flow)
    step = flow.send([Claim.won(), Claim.won()])
    if isolated:
        step = flow.send("savepoint")
    assert isinstance(step, steps.RunHandler)
    deadlock = RuntimeError("driver: deadlock found")
    assert isinstance(flow.send((False, deadlock)), steps.HandlerFailureIn)
    with pytest.raises(idemq.StoreConflictError) as raised:
        flow.send(idemq.StoreConflictError("deadlock"))
    assert raised.value.__cause__ is deadlock


def test_a_lease_batch_completes_each_message_and_releases_a_failed_one():
    _claimed, _handled, outcomes, trail = drive_trail(
        flow_of("a", "b", isolated=True),
        [Claim.won(), Claim.won()],
        {"a": (True, 1), "b": (False, ValueError("boom"))},
    )
    assert trail == ["ClaimMany", "RunHandler", "Complete", "RunHandler", "Release"]
    assert [o.status for o in outcomes] == [Status.PROCESSED, Status.FAILED]


def test_a_lease_lost_at_complete_fails_only_its_message():
    flow = flow_of("a", "b", isolated=True)
    next(flow)
    assert isinstance(flow.send([Claim.won(), Claim.won()]), steps.RunHandler)
    assert isinstance(flow.send((True, 1)), steps.Complete)
    lost = idemq.LeaseLostError("taken over")
    assert isinstance(flow.throw(lost), steps.RunHandler)  # b goes on
    assert isinstance(flow.send((True, 2)), steps.Complete)
    with pytest.raises(StopIteration) as done:
        flow.send(None)
    outcomes = done.value.value
    assert outcomes[0].error is lost
    assert outcomes[1].status is Status.PROCESSED


def test_a_keyboard_interrupt_stops_the_batch_after_releasing_its_lease():
    flow = flow_of("a", "b", isolated=True)
    next(flow)
    flow.send([Claim.won(), Claim.won()])
    interrupt = KeyboardInterrupt()
    assert isinstance(flow.send((False, interrupt)), steps.Release)
    with pytest.raises(KeyboardInterrupt):
        flow.send(None)


def test_passes_go_isolated_once_after_a_handler_failed():
    passes = BatchPasses(owns_transaction=True)
    assert not passes.isolated
    error = ValueError("boom")
    assert passes.again(HandlerFailedError(2, error))
    assert passes.isolated
    assert passes.failures == {2: error}
    # An isolated pass never raises HandlerFailedError; if it did, it would not loop.
    assert not passes.again(HandlerFailedError(0, error))


def test_a_deadlocked_pass_runs_again_a_bounded_number_of_times():
    passes = BatchPasses(owns_transaction=True)
    reruns = 0
    while passes.again(idemq.StoreConflictError("deadlock")):
        reruns += 1
    assert reruns == CLAIM_ATTEMPTS - 1  # CLAIM_ATTEMPTS runs in all


def test_the_deadlock_count_starts_again_with_the_isolated_pass():
    passes = BatchPasses(owns_transaction=True)
    for _ in range(CLAIM_ATTEMPTS - 2):
        assert passes.again(idemq.StoreConflictError("deadlock"))
    assert passes.again(HandlerFailedError(0, ValueError("boom")))
    for _ in range(CLAIM_ATTEMPTS - 1):
        assert passes.again(idemq.StoreConflictError("deadlock"))
    assert not passes.again(idemq.StoreConflictError("deadlock"))


def test_a_deadlock_inside_the_callers_transaction_is_the_callers_to_retry():
    passes = BatchPasses(owns_transaction=False)
    assert not passes.again(idemq.StoreConflictError("deadlock"))
    assert passes.again(HandlerFailedError(0, ValueError("boom")))  # a savepoint each, still


def test_a_message_that_lost_the_transaction_reruns_the_pass_isolated():
    # PostgreSQL: handler "a" caught a failed statement, so the transaction is aborted (the
    # free status check finds it right after that handler): it is a's failure, as if it raised.
    flow = flow_of("a", "b", mode="transactional", isolated=False)
    next(flow)
    assert isinstance(flow.send([Claim.won(), Claim.won()]), steps.RunHandler)
    assert isinstance(flow.send((True, None)), steps.ConfirmIn)
    lost = idemq.TransactionLostError("aborted")
    with pytest.raises(HandlerFailedError) as raised:
        flow.throw(lost)
    assert (raised.value.index, raised.value.error) == (0, lost)


def test_in_an_isolated_pass_a_lost_transaction_fails_only_its_message():
    # Rolling back to the message's savepoint restores PostgreSQL's aborted transaction.
    flow = flow_of("a", "b", mode="transactional", isolated=True)
    next(flow)
    assert isinstance(flow.send([Claim.won(), Claim.won()]), steps.OpenSavepoint)
    assert isinstance(flow.send("sp"), steps.RunHandler)
    assert isinstance(flow.send((True, None)), steps.ConfirmIn)
    close = flow.throw(idemq.TransactionLostError("aborted"))
    assert isinstance(close, steps.CloseSavepoint)
    assert not close.commit
    assert isinstance(flow.send(None), steps.ReleaseIn)
    assert isinstance(flow.send(None), steps.OpenSavepoint)
    assert isinstance(flow.send("sp2"), steps.RunHandler)
    assert isinstance(flow.send((True, None)), steps.ConfirmIn)
    assert isinstance(flow.send(None), steps.CloseSavepoint)
    confirm_many = flow.send(None)
    assert isinstance(confirm_many, steps.ConfirmManyIn)
    assert [r.key.message_id for r in confirm_many.requests] == ["b"]
    with pytest.raises(StopIteration) as stop:
        flow.send(None)
    outcomes = stop.value.value
    assert [o.status for o in outcomes] == [Status.FAILED, Status.PROCESSED]
    assert isinstance(outcomes[0].error, idemq.TransactionLostError)


def test_a_lost_transaction_whose_savepoint_is_gone_fails_the_pass_as_a_conflict():
    # InnoDB rolled the whole transaction back: no savepoint to return to.
    flow = flow_of("a", mode="transactional", isolated=True)
    next(flow)
    flow.send([Claim.won()])
    flow.send("sp")
    flow.send((True, None))
    lost = idemq.TransactionLostError("rolled back")
    assert isinstance(flow.throw(lost), steps.CloseSavepoint)
    with pytest.raises(idemq.TransactionLostError) as raised:
        flow.throw(idemq.StoreError("SAVEPOINT does not exist"))
    assert raised.value is lost
    assert BatchPasses(owns_transaction=True).again(raised.value)  # run again, as a conflict
