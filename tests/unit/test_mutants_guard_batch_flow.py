"""A lease-mode batch, step by step, where mutation testing (docs/how-we-know.md) found no
test that failed: the message a lost claim's outcome names, the fence its handler sees, and
the note a failed release leaves on the handler's error.
"""

from __future__ import annotations

import pytest

import idemq
from idemq.guard import flow as steps
from idemq.guard.batch_flow import batch_flow, plan_batch
from idemq.guard.core import Policy, Status
from idemq.stores.base import Claim


def lease_batch(*ids: str):
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=lambda: 1_000)
    messages = [idemq.Message(id=i, body=b"{}") for i in ids]
    flow = batch_flow(policy, plan_batch(policy, messages), messages, isolated=False)
    assert isinstance(next(flow), steps.ClaimMany)
    return flow


def test_a_claim_lost_before_its_handler_is_that_messages_in_progress():
    flow = lease_batch("m1")
    assert isinstance(flow.send([Claim.won()]), steps.Renew)
    with pytest.raises(StopIteration) as stop:
        flow.send(False)  # a rival took the claim over while earlier handlers ran
    [outcome] = stop.value.value
    assert (outcome.status, outcome.message_id) == (Status.IN_PROGRESS, "m1")


def test_a_batch_handler_sees_its_claims_fence():
    flow = lease_batch("m1")
    flow.send([Claim.won(fence=7)])
    run = flow.send(True)
    assert isinstance(run, steps.RunHandler)
    assert run.context.fence == 7


def test_a_failed_release_is_noted_on_the_batch_handlers_error():
    boom = ValueError("boom")
    flow = lease_batch("m1")
    flow.send([Claim.won()])
    flow.send(True)
    assert isinstance(flow.send((False, boom)), steps.Release)
    with pytest.raises(StopIteration) as stop:
        flow.throw(idemq.StoreUnavailableError("redis down"))
    [outcome] = stop.value.value
    assert (outcome.status, outcome.message_id, outcome.error) == (Status.FAILED, "m1", boom)
    assert any("releasing the claim failed too" in note for note in boom.__notes__)


# Mutants of batch_flow.py left alive, each equivalent:
# - _handle_in_transaction__mutmut_17, _21, _22 (deferred → None / False): each row proven at
#   once instead of in ConfirmManyIn's one read; the same rows commit, one statement more each.
# - HandlerFailedError.__init____mutmut_1 to _4 (the Exception's args): the error is the
#   optimistic pass's signal to BatchPasses, which reads .index and .error; it never escapes.
# - _LeaseHolds.__init____mutmut_1 (terms → None): without renewal `after` answers () for an
#   empty or a None tuple alike; with it, terms is set again before use.
