"""How ``idemq worker`` waits out a broker outage: bounded exponential backoff, one log line per
attempt (no traceback: an unreachable broker is expected, not a bug), and a time after which it
gives up so that a supervisor (systemd, Kubernetes) sees the exit and can act.

A configuration error (a refused login, an unknown vhost) is not an outage: it is raised as
:class:`~idemq.ConfigurationError` by the adapter and never retried here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from idemq.errors import BrokerError, BrokerUnavailableError

__all__ = ["STARTUP_GIVE_UP_AFTER_S", "Outage"]

log = logging.getLogger("idemq.worker")

STARTUP_GIVE_UP_AFTER_S = 30.0
"""How long a worker that never reached its broker keeps trying, unless told otherwise."""


class Outage:
    """The retries of one broker outage: :meth:`failed` after each failed attempt (it waits, or
    raises once ``give_up_after_s`` has passed since the first failure), :meth:`over` once the
    broker answers again. ``give_up_after_s=None``: never give up."""

    def __init__(
        self,
        give_up_after_s: float | None,
        stopping: threading.Event,
        *,
        first_wait_s: float = 0.5,
        max_wait_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.give_up_after_s = give_up_after_s
        self.stopping = stopping
        self.first_wait_s = first_wait_s
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.attempts = 0
        self.started_s: float | None = None

    def attempting(self) -> float | None:
        """An attempt starts: the outage's clock runs from the first one (not from its failure,
        which an attempt waiting out a connect timeout reaches late). Returns the time left
        before giving up (None: never), the bound for this attempt."""
        now = self.clock()
        if self.started_s is None:
            self.started_s = now
        if self.give_up_after_s is None:
            return None
        return max(self.give_up_after_s - (now - self.started_s), 0.0)

    def over(self) -> None:
        """The broker answered: the next failure starts a new outage."""
        self.attempts = 0
        self.started_s = None

    def failed(self, error: BrokerError, doing: str) -> None:
        """Log the failed attempt on one line and wait before the next one; raise
        :class:`BrokerUnavailableError` (``from error``) when it is time to give up."""
        now = self.clock()
        if self.started_s is None:
            self.started_s = now
        self.attempts += 1
        elapsed_s = now - self.started_s
        if self.give_up_after_s is not None and elapsed_s >= self.give_up_after_s:
            raise BrokerUnavailableError(
                f"{doing}: gave up after {self.attempts} attempt{'' if self.attempts == 1 else 's'}"
                f" in {elapsed_s:.1f}s: {error}"
            ) from error
        wait_s = min(self.first_wait_s * 2 ** (self.attempts - 1), self.max_wait_s)
        if self.give_up_after_s is not None:  # the last attempt falls on the deadline
            wait_s = min(wait_s, self.give_up_after_s - elapsed_s)
        log.warning(
            "%s failed (attempt %d), retrying in %.1fs: %s: %s",
            doing,
            self.attempts,
            wait_s,
            type(error).__name__,
            error,
        )
        self.stopping.wait(wait_s)
