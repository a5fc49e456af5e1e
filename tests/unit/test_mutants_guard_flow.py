"""The guard's flow where mutation testing (docs/how-we-know.md) found no test that failed:
a duplicate that waits for a live claim (``wait_s``), the local cache of completed records, and
the fence a lease-mode handler sees. Pinned step by step, with no I/O: the flow has none.

The wait loop was reached by one contract test only, which checks the outcome after a real
wait: a wrong backoff, a pause past the deadline or a re-claim carrying the first request's
time all passed it.
"""

from __future__ import annotations

from typing import Any

import pytest

import idemq
from idemq.guard import flow as steps
from idemq.guard.cache import CompletedCache
from idemq.guard.core import Policy, Status
from idemq.guard.flow import message_flow
from idemq.stores.base import Claim, Record, RecordStatus

START_MS = 1_000


class Clock:
    """Epoch milliseconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now_ms = START_MS

    def __call__(self) -> int:
        return self.now_ms


def live_claim() -> Claim:
    """Another owner's lease, live long after every deadline of these tests."""
    held = Record("c", "m1", RecordStatus.PROCESSING, owner="other", lease_until_ms=10**13)
    return Claim.lost_to(held)


def waiting(clock: Clock, wait_s: float) -> tuple[Any, Any]:
    """A waiting duplicate's flow, and its first step (the claim)."""
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=clock, wait_s=wait_s)
    flow = message_flow(policy, policy.request("m1"), None)
    return flow, next(flow)


def test_the_pauses_double_from_ten_milliseconds_up_to_half_a_second():
    clock = Clock()
    flow, _ = waiting(clock, wait_s=60.0)
    pauses = []
    for _ in range(8):
        pause = flow.send(live_claim())
        assert isinstance(pause, steps.Pause)
        pauses.append(pause.seconds)
        assert isinstance(flow.send(None), steps.Claim)
    assert pauses == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]


def test_each_claim_again_is_made_at_the_clocks_time_for_the_same_message():
    clock = Clock()
    flow, first = waiting(clock, wait_s=60.0)
    assert isinstance(flow.send(live_claim()), steps.Pause)
    clock.now_ms += 250
    again = flow.send(None)
    assert isinstance(again, steps.Claim)
    # A takeover is judged at the claim's time: the first request's would see the lease live.
    assert again.request.now_ms == START_MS + 250
    assert again.request.key == first.request.key
    assert again.request.owner == first.request.owner


def test_the_last_pause_ends_at_the_deadline():
    clock = Clock()
    flow, _ = waiting(clock, wait_s=1.0)
    clock.now_ms = START_MS + 995  # 5 ms before the deadline, less than the first backoff
    pause = flow.send(live_claim())
    assert isinstance(pause, steps.Pause)
    assert pause.seconds == 0.005


def test_at_the_deadline_the_duplicate_is_in_progress_without_another_pause():
    clock = Clock()
    flow, _ = waiting(clock, wait_s=1.0)
    assert isinstance(flow.send(live_claim()), steps.Pause)
    clock.now_ms = START_MS + 1_000  # the deadline, to the millisecond
    assert isinstance(flow.send(None), steps.Claim)
    with pytest.raises(StopIteration) as stop:
        flow.send(live_claim())
    outcome = stop.value.value
    assert outcome.status is Status.IN_PROGRESS
    assert not outcome.should_ack


def test_a_cached_completed_record_answers_duplicate_without_asking_the_store():
    clock = Clock()
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=clock)
    cache = CompletedCache(size=10, ttl_ms=60_000)
    cache.put(Record("c", "m1", RecordStatus.PROCESSED, result='"paid"'), START_MS)
    flow = message_flow(policy, policy.request("m1"), None, cache)
    with pytest.raises(StopIteration) as stop:
        next(flow)  # no claim, no handler: the cache's record is the answer
    assert (stop.value.value.status, stop.value.value.result) == (Status.DUPLICATE, "paid")


def test_a_stale_cache_entry_is_not_an_answer():
    clock = Clock()
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=clock)
    cache = CompletedCache(size=10, ttl_ms=60_000)
    cache.put(Record("c", "m1", RecordStatus.PROCESSED, result='"paid"'), START_MS - 60_000)
    flow = message_flow(policy, policy.request("m1"), None, cache)
    assert isinstance(next(flow), steps.Claim)  # judged at the request's time: expired


@pytest.mark.parametrize(("mode", "seen"), [("lease", 7), ("transactional", None)])
def test_the_handler_sees_its_leases_fence_and_no_fence_in_a_transaction(mode, seen):
    policy = Policy.build(consumer="c", mode=mode, lease_s=30.0, clock=Clock())
    request = policy.request("m1")
    flow = message_flow(policy, request, None)
    next(flow)
    run = flow.send(Claim.won(fence=7))
    assert isinstance(run, steps.RunHandler)
    context = run.context
    assert (context.consumer, context.message_id, context.owner) == ("c", "m1", request.owner)
    assert context.fence == seen


def test_a_claim_that_keeps_conflicting_is_that_messages_in_progress():
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=Clock())
    flow = message_flow(policy, policy.request("m1"), None)
    next(flow)
    with pytest.raises(StopIteration) as stop:
        flow.throw(idemq.StoreConflictError("deadlock, again and again"))
    outcome = stop.value.value
    assert (outcome.status, outcome.message_id) == (Status.IN_PROGRESS, "m1")


def test_a_one_millisecond_wait_still_waits():
    flow, _ = waiting(Clock(), wait_s=0.001)
    pause = flow.send(live_claim())
    assert isinstance(pause, steps.Pause)
    assert pause.seconds == 0.001


def test_a_waiter_that_asks_the_store_late_waits_only_for_the_rest_of_its_wait():
    # The async guard's in-flight waiter, left without a result, goes to the store with the
    # deadline of its first request: its whole wait stays wait_s, not wait_s more.
    clock = Clock()
    policy = Policy.build(consumer="c", mode="lease", lease_s=30.0, clock=clock, wait_s=60.0)
    flow = message_flow(policy, policy.request("m1"), None, wait_until_ms=START_MS + 3)
    next(flow)
    pause = flow.send(live_claim())
    assert isinstance(pause, steps.Pause)
    assert pause.seconds == 0.003


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_processed_outcome_names_its_message(mode):
    policy = Policy.build(consumer="c", mode=mode, lease_s=30.0, clock=Clock())
    flow = message_flow(policy, policy.request("m1"), None)
    next(flow)
    flow.send(Claim.won())
    flow.send((True, "paid"))  # the handler's reply; next: complete or confirm
    with pytest.raises(StopIteration) as stop:
        flow.send(None)
    outcome = stop.value.value
    assert (outcome.status, outcome.message_id, outcome.result) == (Status.PROCESSED, "m1", "paid")


@pytest.mark.parametrize(
    ("mode", "renew", "renewed"),
    [("lease", True, True), ("lease", False, False), ("transactional", True, False)],
)
def test_only_a_renewing_lease_is_kept_alive_while_the_handler_runs(mode, renew, renewed):
    # A transactional row holds no lease: "renewing" it would find none and report it lost.
    policy = Policy.build(consumer="c", mode=mode, lease_s=30.0, clock=Clock(), renew=renew)
    request = policy.request("m1")
    flow = message_flow(policy, request, None)
    next(flow)
    run = flow.send(Claim.won())
    assert isinstance(run, steps.RunHandler)
    assert (run.lease is not None) is renewed
    if renewed:
        assert (run.lease.key, run.lease.owner, run.lease.lease_ms) == (
            request.key,
            request.owner,
            30_000,
        )


# Mutants of flow.py left alive, each equivalent (mutmut names; `mutmut show NAME` for the diff):
# - HandlerFailureIn.call__mutmut_1 (tx → None): every store judges the handler's error alone.
# - ConfirmIn.call__mutmut_5, _10 (deferred → None / False): a batch proves each row at once
#   instead of in ConfirmManyIn's one read; the same rows commit, one statement more each.
# - message_flow__mutmut_32 (`and` → `or` before wait_ms), _36 (wait_ms >= 0), _47 (claim →
#   None): the wait loop runs only while IN_PROGRESS, a zero wait's deadline has passed, and a
#   loop that never claims again returns its first judgement, never the claim.
