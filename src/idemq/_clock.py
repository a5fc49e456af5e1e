"""The one clock of idemq: epoch milliseconds, injected wherever time matters.

Every lease, id and lock takes a ``clock`` argument of this type, so tests move time with a fake
clock instead of sleeping or patching module globals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "process_fence_us", "system_clock_ms"]


Clock = Callable[[], int]
"""A zero-argument callable returning epoch milliseconds."""


def system_clock_ms() -> int:
    """The wall clock in epoch milliseconds (the default clock everywhere in idemq)."""
    return time.time_ns() // 1_000_000


class _ProcessFence:
    """The last fence this process handed out, behind a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_us = 0

    def next(self) -> int:
        with self._lock:
            self._last_us = max(time.time_ns() // 1000, self._last_us + 1)
            return self._last_us


_PROCESS_FENCE = _ProcessFence()


def process_fence_us() -> int:
    """A fencing token from this process's wall clock: epoch microseconds, strictly greater than
    every earlier one this process handed out (a clock that steps back does not make it repeat).
    The fence of the stores without a server clock (SQLite, memory)."""
    return _PROCESS_FENCE.next()
