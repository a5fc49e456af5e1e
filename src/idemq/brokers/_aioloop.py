"""Run an async broker client behind a synchronous adapter: one event loop in its own thread.

aio-pika and nats-py are async-only; the worker is thread-based. Each async adapter owns one
:class:`LoopThread`; the worker's threads hand coroutines to it and wait for the result, and the
client's callbacks push deliveries into an :class:`Inbox` the sync iterator drains. All client
objects are touched only from the loop thread (they are not thread-safe).

Settlements are the exception to "hand over and wait": a blocking hop to the loop and back cost
~0.3 ms per message, as much as the message's whole transaction. :class:`AckQueue` queues them
instead and runs everything queued in one go on the loop; the worker learns of a failure through
the returned future (counted and logged, never silent). While more deliveries are already waiting
for the worker, a settlement is *held* (not even the loop is woken) and goes out with the others
when that backlog runs dry: waking the loop thread once per message made it fight the worker
for the GIL, and the worker lost up to a switch interval (5 ms) each time.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Generic, TypeVar

from idemq.errors import BrokerError, BrokerUnavailableError

T = TypeVar("T")

__all__ = ["AckQueue", "Inbox", "LoopBroker", "LoopThread"]

log = logging.getLogger("idemq.brokers")


class LoopThread:
    """An asyncio loop running forever in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run ``coro`` on the loop and wait for its result (raised errors come back as-is)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except FutureTimeoutError as exc:
            future.cancel()
            raise BrokerUnavailableError(f"broker call timed out after {timeout_s}s") from exc

    def call_later(self, delay_s: float, fn: Callable[[], Awaitable[object]]) -> None:
        """Schedule ``await fn()`` on the loop after ``delay_s`` (does not wait)."""

        def fire() -> None:
            self.loop.create_task(_logged(fn))

        self.loop.call_soon_threadsafe(self.loop.call_later, delay_s, fire)

    def stop(self) -> None:
        """Stop the loop and join its thread (pending timers are dropped)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _logged(fn: Callable[[], Awaitable[object]]) -> None:
    try:
        await fn()
    except Exception as exc:
        # A delayed nack failed (connection gone): the broker requeues unacked messages on
        # disconnect anyway, so one line and move on; the traceback only at DEBUG (an outage
        # would otherwise print one per delivery in flight).
        log.warning("delayed settlement failed: %s: %s", type(exc).__name__, exc)
        log.debug("delayed settlement failed", exc_info=True)


Action = Callable[[], Awaitable[object]]


class AckQueue:
    """Settlements (acks, nacks) queued by worker threads and run on the loop, many per wake-up.

    :meth:`submit` does not wait: the action is appended to a list and the loop is woken only by
    the first one of a burst, so a batch of 100 acks costs one wake-up. On the loop one sender
    takes everything queued, runs each action in order, then ``confirm()`` once if given (NATS:
    a PING/PONG proving the server received every ack written before it; RabbitMQ: the acks its
    actions marked, sent in as few frames as the protocol allows), completes each
    action's future — with a :class:`~idemq.errors.BrokerError` if it (or the confirm) failed —
    and starts over with what was queued meanwhile.

    ``submit(action, hold=True)`` — the adapter's way of saying "more deliveries are waiting for
    this worker" — queues without waking the loop; held actions go out with the next wake-up:
    :meth:`flush` (the adapter calls it when its backlog runs dry, before it blocks for more, and
    on every idle tick), the ``max_held``-th queued action, or one submitted ``max_hold_s`` after
    the oldest held one (a slow handler must not keep acks back past the broker's ack timeout).
    Waiting on a held action's future flushes too, so a caller that waits is never stuck.

    Safety does not rest on the queue: an action is submitted only after the effect committed,
    and one that never runs (the process dies first) or fails leaves the message unacked, so the
    broker redelivers it and the guard answers DUPLICATE. :meth:`drain` (called by the adapter's
    ``close()`` before the connection goes) runs what is queued, so a graceful stop does not
    cause those redeliveries.
    """

    def __init__(
        self,
        loop: LoopThread,
        broker: str,
        confirm: Action | None = None,
        *,
        max_held: int = 100,
        max_hold_s: float = 0.05,
    ) -> None:
        self._loop = loop
        self._broker = broker
        self._confirm = confirm
        self.max_held = max_held
        self.max_hold_s = max_hold_s
        self._lock = threading.Lock()
        self._queued: list[tuple[Action, Future[None]]] = []
        self._oldest_s = 0.0  # monotonic time the first of the queued actions was submitted
        self._woken = False  # a wake-up is scheduled that will take everything queued
        self._sender: asyncio.Task[None] | None = None  # touched on the loop thread only

    def submit(self, action: Action, *, hold: bool = False) -> Future[None]:
        """Queue ``await action()`` on the loop; the future completes once it ran (and was
        confirmed), or with the error that stopped it. ``hold``: see the class docstring."""
        future: Future[None] = _FlushingFuture(self)
        now_s = time.monotonic()
        with self._lock:
            if not self._queued:
                self._oldest_s = now_s
            self._queued.append((action, future))
            wake = not self._woken and (
                not hold
                or len(self._queued) >= self.max_held
                or now_s - self._oldest_s >= self.max_hold_s
            )
            if wake:
                self._woken = True  # later ones ride on the wake-up scheduled
        if wake:
            self._wake()
        return future

    def flush(self) -> None:
        """Wake the loop for whatever is held (a no-op when nothing is, or a wake-up is due)."""
        with self._lock:
            wake = bool(self._queued) and not self._woken
            if wake:
                self._woken = True
        if wake:
            self._wake()

    def _wake(self) -> None:
        try:
            self._loop.loop.call_soon_threadsafe(self._start)
        except RuntimeError as exc:  # the loop is closed: so is the connection
            _fail([f for _, f in self._take()], self._error(exc))

    def drain(self, timeout_s: float) -> None:
        """Wait until everything submitted so far has run (logs what is left on timeout)."""
        try:
            self._loop.run(self._settled(), timeout_s)
        except BrokerError:
            with self._lock:
                left = len(self._queued)
            log.warning(
                "%s: settlements still pending after %.0fs (%d queued); the broker will "
                "redeliver those messages",
                self._broker,
                timeout_s,
                left,
            )

    # -- on the loop thread ----------------------------------------------------------------------

    def _take(self) -> list[tuple[Action, Future[None]]]:
        with self._lock:
            batch, self._queued = self._queued, []
            self._woken = False  # what is queued from now on needs a wake-up of its own
        return batch

    def _start(self) -> None:
        # One sender at a time: what is queued while it awaits (a NATS flush's PONG) goes out
        # in its next round, together — under load, bursts grow instead of flushes multiplying.
        if self._sender is None or self._sender.done():
            self._sender = self._loop.loop.create_task(self._send())

    async def _send(self) -> None:
        while batch := self._take():
            await self._run(batch)

    async def _settled(self) -> None:
        self._start()  # whatever was queued since the last wake-up
        if self._sender is not None:
            await asyncio.wait({self._sender})  # not `await`: a timeout must not cancel it

    async def _run(self, batch: list[tuple[Action, Future[None]]]) -> None:
        done: list[Future[None]] = []
        for action, future in batch:
            try:
                await action()
            except Exception as exc:
                _fail([future], self._error(exc))
            else:
                done.append(future)
        if self._confirm is not None and done:
            try:
                await self._confirm()
            except Exception as exc:
                _fail(done, self._error(exc))
                return
        for future in done:
            future.set_result(None)

    def _error(self, exc: BaseException) -> BrokerError:
        """The driver's exception as a BrokerError (the cause kept), as ``_call`` does."""
        if isinstance(exc, BrokerError):
            return exc
        error = BrokerUnavailableError(
            f"{self._broker}: settlement failed: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error


class LoopBroker:
    """What the adapters of async clients (RabbitMQ, NATS) share: their loop thread, their
    :class:`AckQueue`, and the worker thread's doors onto both.

    ``name`` labels errors and the thread; ``driver_errors`` are the client's exceptions that
    mean the broker is unreachable (raised as :class:`~idemq.errors.BrokerUnavailableError`);
    ``call_timeout_s`` bounds each blocking hop to the loop; ``confirm`` is the AckQueue's.
    """

    def __init__(
        self,
        name: str,
        *,
        driver_errors: tuple[type[BaseException], ...],
        call_timeout_s: float,
        confirm: Action | None = None,
    ) -> None:
        self._name = name
        self._driver_errors = driver_errors
        self._call_timeout_s = call_timeout_s
        self._loop = LoopThread(f"idemq-{name.lower()}")
        self._settler = AckQueue(self._loop, name, confirm)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait, the client's errors translated."""
        try:
            return self._loop.run(coro, self._call_timeout_s)
        except self._driver_errors as exc:
            raise BrokerUnavailableError(f"{self._name}: {type(exc).__name__}: {exc}") from exc

    def settle(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run a settlement coroutine on the loop and wait, translating driver errors."""
        self._call(coro)

    def settle_soon(self, action: Action, *, hold: bool = False) -> Future[None]:
        """Queue a settlement on the loop (see :class:`AckQueue`); do not wait."""
        return self._settler.submit(action, hold=hold)

    def settle_later(self, delay_s: float, action: Action) -> None:
        """Run ``action`` on the loop after ``delay_s``; the message stays unacked (invisible)
        until then."""
        self._loop.call_later(delay_s, action)


class _FlushingFuture(Future[None]):
    """A settlement's future: waiting on it first flushes its settler, so a held action that
    someone waits for goes out now instead of at the next flush."""

    def __init__(self, settler: AckQueue) -> None:
        super().__init__()
        self._settler = settler

    def result(self, timeout: float | None = None) -> None:
        if not self.done():
            self._settler.flush()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._settler.flush()
        return super().exception(timeout)


def _fail(futures: list[Future[None]], error: BrokerError) -> None:
    for future in futures:
        future.set_exception(error)


class Inbox(Generic[T]):
    """Deliveries handed from the loop thread to the worker's thread, a burst at a time.

    The loop thread puts a list (what arrived in one turn of the loop): one lock and at most one
    wake-up of the worker per burst, not per delivery. ``on_dry`` runs whenever the worker is
    about to wait for a delivery (none is waiting) and on every idle tick: the adapter flushes
    its held settlements there.
    """

    def __init__(self, idle_s: float = 0.2, on_dry: Callable[[], None] | None = None) -> None:
        self._queue: queue.Queue[list[T]] = queue.Queue()
        self._burst: deque[T] = deque()  # the burst being handed out (worker thread only)
        self.idle_s = idle_s
        self.closed = threading.Event()
        self._on_dry = on_dry or (lambda: None)

    def put(self, items: list[T]) -> None:
        """Hand ``items`` over (the caller does not touch the list afterwards)."""
        self._queue.put(items)

    def backlog(self) -> bool:
        """True when deliveries are waiting: the worker will be back for them soon (ask from
        the worker's thread)."""
        return bool(self._burst) or not self._queue.empty()

    def drain(self) -> Iterator[T | None]:
        """Items as they come; ``None`` after ``idle_s`` without one; ends when closed."""
        get = self._queue.get
        burst = self._burst
        while not self.closed.is_set():
            if burst:
                yield burst.popleft()
                continue
            try:
                burst.extend(get(block=False))
                continue
            except queue.Empty:
                self._on_dry()
            try:
                burst.extend(get(timeout=self.idle_s))
            except queue.Empty:
                self._on_dry()
                yield None
