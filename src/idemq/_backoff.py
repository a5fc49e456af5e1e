"""The one backoff of idemq: how long to wait before the next try, growing with each failure.

Every place that tries again — a handler's failed delivery, a broker outage, a refused outbox
row, an unconfirmed publish, a lock held by another owner, a deadlocked transaction, a duplicate
waiting for its twin — asks a :class:`Backoff` for its wait, so the rule (double from ``first_s``
up to ``max_s``, minus a random share) is written once and tested once.

Jitter matters where many waiters fail *together*: the racers of one deadlock, or the waiters a
lock's expiry releases at once, would otherwise try again in lock-step and collide again. The
randomness is injected (``random`` argument) so tests can pin it.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: ``first_s`` before the second try, doubling up to ``max_s``.

    ``jitter`` is the share of each wait that is drawn at random below it: 0 waits exactly,
    0.5 waits between half and all of it, 1 anywhere from nothing to all of it ("full jitter").
    A wait never exceeds ``max_s``.
    """

    first_s: float
    max_s: float
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be between 0 and 1, got {self.jitter!r}")

    def delay_s(self, attempt: int, random: Callable[[], float] = _random.random) -> float:
        """The wait after failed try number ``attempt`` (1-based: the first failure waits
        ``first_s``); ``random`` returns a float in [0, 1) and is called only with jitter."""
        # The exponent is capped so a long outage cannot overflow the float.
        exponent = min(max(attempt - 1, 0), 64)
        delay = min(self.max_s, self.first_s * 2.0**exponent)
        if self.jitter:
            delay *= 1.0 - self.jitter * random()
        return float(delay)
