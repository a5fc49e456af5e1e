"""How an idemq process waits out an outage of its broker or its store: the one policy that
``idemq worker`` (its consumer and its ``--relay`` thread alike) and ``idemq relay`` follow.

Bounded exponential backoff (:class:`~idemq._backoff.Backoff`), one log line per attempt (no
traceback: an unreachable broker is expected, not a bug), and a time after which it gives up so
that a supervisor (systemd, Kubernetes) sees the exit and can act. One policy per process: a
worker that gave up while its relay thread kept retrying (or the reverse) would leave the
supervisor a process that is half alive.

A configuration error (a refused login, an unknown vhost) is not an outage: it is raised as
:class:`~idemq.ConfigurationError` by the adapter and never retried here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from idemq._backoff import Backoff
from idemq.errors import BrokerError, BrokerUnavailableError, StoreError, StoreUnavailableError

__all__ = ["OUTAGE_BACKOFF", "STARTUP_GIVE_UP_AFTER_S", "Outage"]

log = logging.getLogger("idemq.outage")

STARTUP_GIVE_UP_AFTER_S = 30.0
"""How long a worker that never reached its broker keeps trying, unless told otherwise."""


OUTAGE_BACKOFF = Backoff(0.5, 30.0)
"""Half a second after the first failure, doubling to 30 s: a blip is over quickly, a long outage
is not hammered."""


class Outage:
    """The retries of one outage: :meth:`failed` after each failed attempt (it waits, or raises
    once ``give_up_after_s`` has passed since the first failure), :meth:`over` once the broker
    or store answers again. ``give_up_after_s=None``: never give up. ``stopping`` cuts a wait
    short (the process is stopping)."""

    def __init__(
        self,
        give_up_after_s: float | None,
        stopping: threading.Event,
        *,
        backoff: Backoff = OUTAGE_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.give_up_after_s = give_up_after_s
        self.stopping = stopping
        self.backoff = backoff
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
        """The broker or store answered: the next failure starts a new outage."""
        self.attempts = 0
        self.started_s = None

    def failed(self, error: BrokerError | StoreError, doing: str) -> None:
        """Log the failed attempt on one line and wait before the next one; when it is time to
        give up, raise :class:`BrokerUnavailableError` (for a broker's error) or
        :class:`StoreUnavailableError` (for a store's), ``from error``."""
        now = self.clock()
        if self.started_s is None:
            self.started_s = now
        self.attempts += 1
        elapsed_s = now - self.started_s
        if self.give_up_after_s is not None and elapsed_s >= self.give_up_after_s:
            given_up = (
                BrokerUnavailableError if isinstance(error, BrokerError) else StoreUnavailableError
            )
            raise given_up(
                f"{doing}: gave up after {self.attempts} attempt{'' if self.attempts == 1 else 's'}"
                f" in {elapsed_s:.1f}s: {error}"
            ) from error
        wait_s = self.backoff.delay_s(self.attempts)
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
