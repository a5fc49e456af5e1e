"""The outage policy's retries, on a fake clock: backoff doubles up to its cap, the last wait
ends on the deadline, giving up raises BrokerUnavailableError from the last error."""

from __future__ import annotations

import threading

import pytest

from idemq._backoff import Backoff
from idemq._outage import Outage
from idemq.errors import BrokerUnavailableError, StoreUnavailableError


class FakeStop(threading.Event):
    """A stop event whose wait() advances the fake clock instead of sleeping."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(round(timeout, 3))
        self.clock[0] += timeout
        return False


def test_backoff_doubles_to_its_cap_then_gives_up_on_the_deadline(caplog):
    now = [100.0]
    stop = FakeStop(now)
    outage = Outage(20.0, stop, backoff=Backoff(0.5, 4.0), clock=lambda: now[0])
    down = BrokerUnavailableError("connection refused")
    for _ in range(8):  # 0 s … 19.5 s: each waits
        outage.failed(down, "connecting to amqp://x/")
    with pytest.raises(BrokerUnavailableError) as raised:  # at 20 s: given up
        outage.failed(down, "connecting to amqp://x/")
    assert stop.waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 0.5]  # the last one ends at 20 s
    assert raised.value.__cause__ is down
    assert "gave up after 9 attempts in 20.0s: connection refused" in str(raised.value)
    lines = [r.getMessage() for r in caplog.records if r.name == "idemq.outage"]
    assert len(lines) == 8  # one per attempt retried
    assert lines[0] == (
        "connecting to amqp://x/ failed (attempt 1), retrying in 0.5s: "
        "BrokerUnavailableError: connection refused"
    )
    assert all(r.exc_info is None for r in caplog.records)  # no traceback


def test_an_answer_starts_the_next_outage_afresh_and_none_never_gives_up():
    now = [0.0]
    stop = FakeStop(now)
    outage = Outage(None, stop, backoff=Backoff(1.0, 30.0), clock=lambda: now[0])
    for _ in range(50):  # hours of outage: never raised
        outage.failed(BrokerUnavailableError("down"), "consuming q")
    assert stop.waits[-1] == 30.0
    outage.over()
    outage.failed(BrokerUnavailableError("down"), "consuming q")
    assert stop.waits[-1] == 1.0
    assert outage.attempts == 1


def test_the_budget_runs_from_the_first_attempt_not_from_its_failure():
    # A Kafka or NATS connect attempt waits out its timeout before failing: counted from the
    # failure, --give-up-after 3 took two 10 s attempts (22 s).
    now = [0.0]
    outage = Outage(3.0, FakeStop(now), clock=lambda: now[0])
    assert outage.attempting() == 3.0  # the whole budget is this attempt's bound
    now[0] = 3.0  # the attempt used it all, then failed
    with pytest.raises(BrokerUnavailableError, match=r"gave up after 1 attempt in 3\.0s"):
        outage.failed(BrokerUnavailableError("connect timed out"), "connecting")


def test_a_store_outage_gives_up_as_the_store_being_unavailable():
    # The relay waits out its database with the same policy: giving up names the store.
    now = [0.0]
    outage = Outage(0.5, FakeStop(now), clock=lambda: now[0])
    down = StoreUnavailableError("connection refused")
    outage.failed(down, "relaying t")
    with pytest.raises(StoreUnavailableError, match="relaying t: gave up after 2") as raised:
        outage.failed(down, "relaying t")
    assert raised.value.__cause__ is down
