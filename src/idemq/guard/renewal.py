"""Lease renewal while a handler runs: a handler longer than its lease must not lose it.

In lease mode a claim expires ``lease_s`` after it was made. A handler that runs longer would be
taken over by a redelivery and run twice, so while it runs its claim is renewed every
``lease_s / 3``::

    t=0      claim, lease until 30 s          (lease_s=30)
    t=10 s   renew → lease until 40 s
    t=20 s   renew → lease until 50 s         the handler is still running: nobody takes over
    t=25 s   handler done → complete

When a renewal finds the claim gone (the worker was paused past its lease and another took the
message over) the handler is told: :attr:`HandlerContext.lease_lost` turns true (and an async
handler's task is cancelled), and ``complete`` is refused with :class:`~idemq.LeaseLostError`
as always. A store that cannot be reached is retried; once a whole lease has passed without a
successful renewal the claim may have been taken, so it is reported lost rather than assumed
held.

Sync guards keep their claims with one :class:`LeaseKeeper` thread per guard (not one per
message); async guards with one task per running handler (:func:`keep_async`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from idemq._clock import Clock
from idemq.errors import StoreError
from idemq.guard.context import HandlerContext
from idemq.stores.base import Key

__all__ = ["LeaseKeeper", "LeaseTerms", "keep_async"]

log = logging.getLogger("idemq.guard")


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """The claim a running handler holds: whose, and for how long each renewal extends it."""

    key: Key
    owner: str
    lease_ms: int

    @property
    def interval_s(self) -> float:
        """How often the claim is renewed: a third of the lease, so two renewals may fail."""
        return self.lease_ms / 3000


@dataclass(slots=True, eq=False)
class _Kept:
    terms: LeaseTerms
    context: HandlerContext
    next_at: float  # monotonic
    last_ok: float  # monotonic


Renew = Callable[[Key, str, int, int], bool]
"""``store.renew(key, owner, lease_until_ms, now_ms) -> still held``."""


def _renewed(kept: _Kept, held: bool | None, now: float) -> None:
    """What one renewal's answer means for the handler (None: the store could not be reached)."""
    if held:
        kept.last_ok = now
    elif held is False or (now - kept.last_ok) * 1000 >= kept.terms.lease_ms:
        if not kept.context.lease_lost:
            log.warning(
                "idemq lease lost while its handler ran: %s (%s)",
                kept.terms.key.message_id,
                kept.terms.key.consumer,
            )
        kept.context.mark_lease_lost()


@dataclass(eq=False)
class LeaseKeeper:
    """Renews the claims of a sync guard's running handlers, from one thread of its own.

    The thread starts with the first claim to keep and ends once none was kept for
    ``idle_exit_s``, so an idle guard holds no thread, and a guard handling one message after
    another does not start a thread per message. Nobody wakes the thread: a new claim is never
    due before the ones it already watches (they all renew every ``lease_s / 3``), and an idle
    thread looks again every interval, which is before any new claim's first renewal is due.
    """

    renew: Renew
    clock: Clock
    monotonic: Callable[[], float] = time.monotonic
    idle_exit_s: float = 10.0
    _kept: set[_Kept] = field(default_factory=set)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    _interval_s: float = 1.0
    _idle_since: float = 0.0

    @contextmanager
    def keeping(self, terms: LeaseTerms, context: HandlerContext) -> Iterator[None]:
        """Renew ``terms``' claim until the block ends."""
        now = self.monotonic()
        kept = _Kept(terms, context, now + terms.interval_s, now)
        with self._cond:
            self._kept.add(kept)
            self._interval_s = terms.interval_s
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idemq-lease-keeper", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._cond:
                self._kept.discard(kept)
                if not self._kept:
                    self._idle_since = self.monotonic()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = self.monotonic()
                if not self._kept:
                    if now - self._idle_since >= self.idle_exit_s:
                        self._thread = None
                        return
                    self._cond.wait(self._interval_s)
                    continue
                due = [kept for kept in self._kept if kept.next_at <= now]
                if not due:
                    self._cond.wait(min(kept.next_at for kept in self._kept) - now)
                    continue
                for kept in due:
                    kept.next_at = now + kept.terms.interval_s
            for kept in due:  # outside the lock: a slow store must not block keeping()
                held = self._renew_once(kept)
                with self._cond:
                    if kept in self._kept:  # not a handler that finished meanwhile
                        _renewed(kept, held, self.monotonic())

    def _renew_once(self, kept: _Kept) -> bool | None:
        terms = kept.terms
        now_ms = self.clock()
        try:
            return self.renew(terms.key, terms.owner, now_ms + terms.lease_ms, now_ms)
        except StoreError as exc:
            log.warning("idemq lease renewal of %s failed: %s", terms.key.message_id, exc)
            return None


async def keep_async(
    renew: Callable[[Key, str, int, int], Any],
    clock: Clock,
    terms: LeaseTerms,
    context: HandlerContext,
    handler: asyncio.Future[Any],
) -> None:
    """Renew ``terms``' claim every ``interval_s`` until cancelled; when the claim is lost,
    cancel ``handler`` (the handler's task), after marking ``context``."""
    kept = _Kept(terms, context, 0.0, time.monotonic())
    while not context.lease_lost:
        await asyncio.sleep(terms.interval_s)
        now_ms = clock()
        try:
            held: bool | None = bool(
                await renew(terms.key, terms.owner, now_ms + terms.lease_ms, now_ms)
            )
        except StoreError as exc:
            log.warning("idemq lease renewal of %s failed: %s", terms.key.message_id, exc)
            held = None
        _renewed(kept, held, time.monotonic())
    handler.cancel()
