"""The one clock of idemq: epoch milliseconds, injected wherever time matters.

Every lease, id and lock takes a ``clock`` argument of this type, so tests move time with a fake
clock instead of sleeping or patching module globals.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Clock", "system_clock_ms"]


Clock = Callable[[], int]
"""A zero-argument callable returning epoch milliseconds."""


def system_clock_ms() -> int:
    """The wall clock in epoch milliseconds (the default clock everywhere in idemq)."""
    return time.time_ns() // 1_000_000
