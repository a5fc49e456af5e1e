"""The I/O-free flow of ``process_batch``: which steps it asks for, and when a pass runs again.

The contract suite runs the same flow through the sync and async guards on every store; these
tests drive it by hand, so each decision is pinned without a database.
"""

from __future__ import annotations

from typing import Any

import pytest

import idemq
from idemq.guard.batch_flow import BatchPasses, Handle, HandlerFailedError, batch_flow, plan_batch
from idemq.guard.core import CLAIM_ATTEMPTS, Policy, Status
from idemq.stores.base import Claim, Record, RecordStatus


def plan_of(*ids: str):
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=lambda: 1_000)
    messages = [idemq.Message(id=i, body=b"{}") for i in ids]
    return plan_batch(policy, messages), messages


def drive(flow, claims: list[Claim], replies: dict[str, tuple[bool, Any]]):
    """Answer the flow's steps; returns (claimed ids, handled ids, outcomes)."""
    claimed: list[str] = []
    handled: list[str] = []
    reply: Any = None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            return claimed, handled, stop.value
        if isinstance(step, list):
            claimed = [r.key.message_id for r in step]
            reply = claims[: len(step)]
        else:
            assert isinstance(step, Handle)
            handled.append(step.request.key.message_id)
            reply = replies[step.request.key.message_id]


def done(message_id: str, payload_hash: str | None = None) -> Claim:
    return Claim.lost_to(
        Record("c", message_id, RecordStatus.PROCESSED, payload_hash=payload_hash, result='"old"')
    )


def test_new_messages_are_handled_and_duplicates_replayed_without_running():
    plan, messages = plan_of("a", "b", "c")
    boom = ValueError("boom")
    claimed, handled, outcomes = drive(
        batch_flow(plan, messages, isolated=True),
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
    plan, messages = plan_of("a", "b", "c")
    boom = ValueError("boom")
    with pytest.raises(HandlerFailedError) as caught:
        drive(
            batch_flow(plan, messages, isolated=False),
            [Claim.won()] * 3,
            {"a": (True, None), "b": (False, boom)},
        )
    assert (caught.value.index, caught.value.error) == (1, boom)


def test_an_isolated_pass_neither_claims_nor_reruns_the_message_that_failed():
    plan, messages = plan_of("a", "b", "c")
    boom = ValueError("boom")
    claimed, handled, outcomes = drive(
        batch_flow(plan, messages, isolated=True, failures={1: boom}),
        [Claim.won(), Claim.won()],
        {"a": (True, None), "c": (True, None)},
    )
    assert claimed == handled == ["a", "c"]
    assert [o.status for o in outcomes] == [Status.PROCESSED, Status.FAILED, Status.PROCESSED]
    assert outcomes[1].error is boom


def test_a_payload_mismatch_fails_only_its_message():
    plan, messages = plan_of("a", "b")
    _claimed, handled, outcomes = drive(
        batch_flow(plan, messages, isolated=False),
        [done("a", payload_hash="another body"), Claim.won()],
        {"b": (True, None)},
    )
    assert handled == ["b"]
    assert isinstance(outcomes[0].error, idemq.PayloadMismatchError)
    assert outcomes[1].status is Status.PROCESSED


def test_a_batch_with_nothing_to_claim_asks_for_nothing():
    plan, messages = plan_of("a")
    boom = ValueError("boom")
    claimed, handled, outcomes = drive(
        batch_flow(plan, messages, isolated=True, failures={0: boom}), [], {}
    )
    assert (claimed, handled) == ([], [])
    assert outcomes[0].error is boom


@pytest.mark.parametrize("isolated", [False, True])
def test_each_handle_step_says_whether_the_shell_isolates_it(isolated: bool):
    plan, messages = plan_of("a", "b")
    flow = batch_flow(plan, messages, isolated=isolated)
    next(flow)  # the claim step
    step = flow.send([Claim.won(), Claim.won()])
    assert isinstance(step, Handle)
    assert (step.request.key.message_id, step.isolated) == ("a", isolated)


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
