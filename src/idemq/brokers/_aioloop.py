"""Run an async broker client behind a synchronous adapter: one event loop in its own thread.

aio-pika and nats-py are async-only; the worker is thread-based. Each async adapter owns one
:class:`LoopThread`; the worker's threads hand coroutines to it and wait for the result, and the
client's callbacks push deliveries into an :class:`Inbox` the sync iterator drains. All client
objects are touched only from the loop thread (they are not thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Generic, TypeVar

from idemq.errors import BrokerUnavailableError

T = TypeVar("T")

__all__ = ["Inbox", "LoopThread"]

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
    except Exception:
        # A delayed nack failed (connection gone): the broker requeues unacked messages on
        # disconnect anyway, so log and move on.
        log.warning("delayed settlement failed", exc_info=True)


class Inbox(Generic[T]):
    """Deliveries handed from the loop thread to the worker's thread."""

    def __init__(self, idle_s: float = 0.2) -> None:
        self._queue: queue.Queue[T] = queue.Queue()
        self.idle_s = idle_s
        self.closed = threading.Event()

    def put(self, item: T) -> None:
        self._queue.put(item)

    def drain(self) -> Iterator[T | None]:
        """Items as they come; ``None`` after ``idle_s`` without one; ends when closed."""
        while not self.closed.is_set():
            try:
                yield self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                yield None
