"""``AckQueue``: acks queued to an event-loop thread, run in bursts, failures in the futures.

Plain coroutines stand in for the client's ack calls: what is tested is the queueing, not a broker
(the broker contract tests run the real clients).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from idemq.brokers._aioloop import AckQueue, LoopThread
from idemq.errors import BrokerUnavailableError


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-settler")
    yield thread
    thread.stop()


class Recorder:
    """Actions that log their name (and the burst they ran in) when the loop runs them."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.confirms = 0

    def action(self, name: str, fail: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await asyncio.sleep(0)
            if fail:
                raise ConnectionResetError(f"{name} lost")
            self.ran.append(name)

        return run

    async def confirm(self) -> None:
        self.confirms += 1


def test_submit_does_not_wait_and_a_burst_runs_in_order_with_one_confirm(
    loop: LoopThread,
) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test", confirm=recorder.confirm)
    release = threading.Event()
    loop.loop.call_soon_threadsafe(release.wait, 5)  # the loop is busy: acks must queue up
    futures = [settler.submit(recorder.action(f"a{i}")) for i in range(5)]
    assert not any(f.done() for f in futures)
    release.set()
    assert [f.result(5) for f in futures] == [None] * 5
    assert recorder.ran == ["a0", "a1", "a2", "a3", "a4"]
    assert recorder.confirms == 1  # one burst, one confirm


def test_a_failed_action_fails_only_its_future_as_a_broker_error(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test")
    futures = [
        settler.submit(recorder.action("ok1")),
        settler.submit(recorder.action("bad", fail=True)),
        settler.submit(recorder.action("ok2")),
    ]
    settler.drain(5)
    assert futures[0].exception(0) is None
    assert futures[2].exception(0) is None
    error = futures[1].exception(0)
    assert isinstance(error, BrokerUnavailableError)
    assert isinstance(error.__cause__, ConnectionResetError)
    assert recorder.ran == ["ok1", "ok2"]


def test_a_failed_confirm_fails_every_action_of_its_burst(loop: LoopThread) -> None:
    async def confirm() -> None:
        raise TimeoutError("no PONG")

    recorder = Recorder()
    settler = AckQueue(loop, "test", confirm=confirm)
    release = threading.Event()
    loop.loop.call_soon_threadsafe(release.wait, 5)
    futures = [settler.submit(recorder.action(f"a{i}")) for i in range(3)]
    release.set()
    settler.drain(5)
    assert all(isinstance(f.exception(0), BrokerUnavailableError) for f in futures)


def test_drain_waits_for_everything_queued(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test")
    loop.loop.call_soon_threadsafe(time.sleep, 0.3)  # nothing runs for a while
    futures = [settler.submit(recorder.action(f"a{i}")) for i in range(50)]
    settler.drain(5)
    assert all(f.done() for f in futures)
    assert len(recorder.ran) == 50


def test_a_submit_after_the_loop_closed_fails_at_once(loop: LoopThread) -> None:
    settler = AckQueue(loop, "test")
    loop.stop()
    future = settler.submit(Recorder().action("late"))
    assert isinstance(future.exception(0), BrokerUnavailableError)


# -- held settlements (a backlog of deliveries is waiting) -------------------------------------


def test_held_actions_wait_for_a_flush_then_go_in_one_burst(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test", confirm=recorder.confirm, max_hold_s=60)
    futures = [settler.submit(recorder.action(f"h{i}"), hold=True) for i in range(3)]
    time.sleep(0.1)
    assert recorder.ran == []  # the loop was never woken
    assert not any(f.done() for f in futures)
    settler.flush()
    settler.drain(5)
    assert recorder.ran == ["h0", "h1", "h2"]
    assert recorder.confirms == 1
    assert all(f.done() and f.exception(0) is None for f in futures)


def test_an_unheld_action_takes_the_held_ones_with_it(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test", max_hold_s=60)
    held = settler.submit(recorder.action("held"), hold=True)
    last = settler.submit(recorder.action("last"))  # the backlog ran dry: send now
    last.result(5)
    assert held.done()
    assert recorder.ran == ["held", "last"]


def test_the_max_held_th_action_sends_the_lot(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test", max_held=4, max_hold_s=60)
    futures = [settler.submit(recorder.action(f"h{i}"), hold=True) for i in range(4)]
    deadline = time.monotonic() + 5
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.ran == ["h0", "h1", "h2", "h3"]


def test_a_held_action_is_sent_once_the_oldest_is_max_hold_s_old(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test", max_hold_s=0.05)
    first = settler.submit(recorder.action("old"), hold=True)
    time.sleep(0.1)  # a slow handler: acks must not wait for the backlog past max_hold_s
    second = settler.submit(recorder.action("new"), hold=True)
    deadline = time.monotonic() + 5
    while not (first.done() and second.done()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.ran == ["old", "new"]


def test_waiting_on_a_held_action_sends_it(loop: LoopThread) -> None:
    recorder = Recorder()
    settler = AckQueue(loop, "test", max_hold_s=60)
    future = settler.submit(recorder.action("waited"), hold=True)
    assert future.result(5) is None  # no flush from anyone else: the wait itself flushes
    assert recorder.ran == ["waited"]
    other = settler.submit(recorder.action("failing", fail=True), hold=True)
    assert isinstance(other.exception(5), BrokerUnavailableError)
