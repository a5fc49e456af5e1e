"""The lock's sans-I/O plans, driven by hand: each step the plan asks for is answered here as
Redis would answer it, so the retry schedule, the deadline and the watchdog's give-up rule are
checked without a server or a sleep (the scripts themselves run on Redis in tests/contract)."""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

import pytest

from idemq._backoff import Backoff
from idemq.drivers.redis import EXTEND_IF_OWNER, Pause, RunScript
from idemq.errors import ConfigurationError, StoreUnavailableError
from idemq.lock.scripts import ACQUIRE, RELEASE, LockKeys, acquire, release, renew


class Clock:
    """A monotonic clock that moves only when a Pause is answered."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def finish(plan: Generator[Any, Any, Any], reply: Any) -> Any:
    with pytest.raises(StopIteration) as stop:
        plan.send(reply)
    return stop.value.value


KEYS = LockKeys.build("lock", "orders")


def acquiring(
    *,
    blocking: bool = True,
    timeout_s: float | None = None,
    poll_s: float = 0.01,
    max_poll_s: float = 1.0,
    clock: Clock | None = None,
) -> Generator[Any, Any, int | None]:
    """An acquire of KEYS by owner "tok" for 5 s, with a seeded jitter."""
    return acquire(
        KEYS,
        "tok",
        5000,
        blocking=blocking,
        timeout_s=timeout_s,
        backoff=Backoff(poll_s, max_poll_s, jitter=0.5),
        rng=random.Random(3),
        monotonic=clock or Clock(),
    )


def test_the_lock_and_its_fence_counter_share_one_hash_tag():
    keys = LockKeys.build("app", "order}42")
    # A raw "}" would close the tag early and send the two keys to different Cluster slots.
    assert keys.lock == "app:{order%7D42}"
    assert keys.fence == "app:{order%7D42}:fence"
    assert keys.both == (keys.lock, keys.fence)


@pytest.mark.parametrize(
    ("prefix", "name"), [("lock", ""), ("lock", 7), ("", "x"), ("a{b", "x"), ("a}", "x")]
)
def test_an_empty_name_or_a_prefix_with_braces_is_refused(prefix: str, name: object):
    with pytest.raises(ConfigurationError):
        LockKeys.build(prefix, name)  # type: ignore[arg-type]


def test_acquire_returns_the_fencing_token_from_the_first_script_run():
    plan = acquiring()
    step = next(plan)
    assert step == RunScript(ACQUIRE, KEYS.both, ("tok", 5000))
    assert finish(plan, 17) == 17


def test_a_non_blocking_acquire_tries_once_and_never_waits():
    plan = acquiring(blocking=False)
    next(plan)
    assert finish(plan, 0) is None  # someone else holds it


def test_polling_backs_off_exponentially_with_jitter_up_to_the_cap():
    plan = acquiring(poll_s=0.1, max_poll_s=0.8)
    next(plan)
    delays = []
    for _ in range(7):
        pause = plan.send(0)
        assert isinstance(pause, Pause)
        delays.append(pause.seconds)
        assert isinstance(plan.send(False), RunScript)
    bases = [min(0.8, 0.1 * 2**n) for n in range(7)]
    # Up to half of each wait drawn at random: waiters freed by one expiry do not retry in
    # lock-step.
    for delay, base in zip(delays, bases, strict=True):
        assert 0.5 * base <= delay <= base
    assert max(delays) <= 1.2


def test_a_timed_acquire_never_waits_past_its_deadline_and_then_gives_up():
    clock = Clock()
    plan = acquiring(timeout_s=1.0, poll_s=0.4, max_poll_s=10.0, clock=clock)
    next(plan)
    deadline = clock.now_s + 1.0
    step = plan.send(0)
    while isinstance(step, Pause):
        assert clock.now_s + step.seconds <= deadline + 1e-9
        clock.now_s += step.seconds
        assert isinstance(plan.send(False), RunScript)
        if clock.now_s >= deadline:
            break
        step = plan.send(0)
    assert finish(plan, 0) is None
    assert clock.now_s == pytest.approx(deadline)


def test_release_says_whether_the_lock_was_ours():
    plan = release(KEYS, "tok")
    assert next(plan) == RunScript(RELEASE, (KEYS.lock,), ("tok",))
    assert finish(plan, 1) is True
    plan = release(KEYS, "tok")
    next(plan)
    assert finish(plan, 0) is False  # expired and maybe re-acquired: the other lock survives


def watchdog(clock: Clock, *, max_renewals: int | None = None) -> Generator[Any, Any, bool]:
    return renew(KEYS, "tok", 3000, interval_s=1.0, max_renewals=max_renewals, monotonic=clock)


def test_the_watchdog_extends_every_interval_until_told_to_stop():
    clock = Clock()
    plan = watchdog(clock)
    assert next(plan) == Pause(1.0)
    for _ in range(3):
        clock.now_s += 1.0
        assert plan.send(False) == RunScript(EXTEND_IF_OWNER, (KEYS.lock,), ("tok", 3000))
        assert plan.send(1) == Pause(1.0)
    assert finish(plan, True) is False  # stopped by the owner: not lost


def test_the_watchdog_reports_the_lock_lost_when_it_is_someone_elses():
    clock = Clock()
    plan = watchdog(clock)
    next(plan)
    plan.send(False)
    assert finish(plan, 0) is True


def test_an_outage_shorter_than_the_ttl_is_ridden_out_a_whole_ttl_is_a_loss():
    clock = Clock()
    plan = watchdog(clock)
    next(plan)
    outage = StoreUnavailableError("redis down")
    for _ in range(2):  # 1 s and 2 s without a renewal: the 3 s lease may still be ours
        clock.now_s += 1.0
        plan.send(False)
        assert plan.throw(outage) == Pause(1.0)
    clock.now_s += 1.0
    plan.send(False)
    with pytest.raises(StopIteration) as stop:
        plan.throw(outage)  # 3 s: the lease may have expired and been taken
    assert stop.value.value is True


def test_the_watchdog_stops_after_max_renewals_and_lets_the_lock_expire():
    clock = Clock()
    plan = watchdog(clock, max_renewals=2)
    next(plan)
    plan.send(False)
    assert plan.send(1) == Pause(1.0)
    plan.send(False)
    assert finish(plan, 1) is False
