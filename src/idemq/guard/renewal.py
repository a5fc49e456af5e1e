"""Lease renewal while a handler runs: a handler longer than its lease must not lose it.

In lease mode a claim expires ``lease_s`` after it was made. A handler that runs longer would be
taken over by a redelivery and run twice, so while it runs its claim is renewed every
``lease_s / 3``::

    t=0      claim, lease until 30 s          (lease_s=30)
    t=10 s   renew → lease until 40 s
    t=20 s   renew → lease until 50 s         the handler is still running: nobody takes over
    t=25 s   handler done → complete

A lease-mode batch holds the claims of its later messages while an earlier handler runs; those
are renewed the same way (:meth:`LeaseKeeper.holding`), or a batch longer than ``lease_s`` would
lose them to a rival that then completes them — and the batch would run them a second time.

When a renewal finds the claim gone (the worker was paused past its lease and another took the
message over) the handler is told: :attr:`HandlerContext.lease_lost` turns true (and an async
handler is cancelled where it awaits), and ``complete`` is refused with
:class:`~idemq.LeaseLostError` as always.

The handler is told on time however the store fails. A renewal is *confirmed* when the store
answered that the claim is still held; the lease then runs ``lease_s`` from when that renewal
was *sent*. Once no renewal was confirmed for ``lease_s`` minus a margin (a tenth of the lease),
judged on this process's monotonic clock, the claim is reported lost — whether the renewals
failed fast (a refused connection), failed slowly (a socket timeout), or never came back (a
connection that went silent: packets dropped, no reset). Waiting for a renewal to answer before
judging would leave the handler unwarned for as long as the driver waits, which is forever for a
connection without a socket timeout.

Renewals never wait behind one another: each is sent from a short-lived thread of its own (a
task of its own on an async guard), so one renewal stuck on a silent pooled connection delays
no other claim's renewal; a claim has at most one renewal out at a time, so a stuck one ties up
one connection, not one per interval.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from idemq._clock import Clock
from idemq.errors import StoreError
from idemq.guard.context import HandlerContext
from idemq.stores.base import Key

__all__ = [
    "MAX_RENEWALS_IN_FLIGHT",
    "AsyncHolding",
    "AsyncKeeping",
    "Holding",
    "Kept",
    "LeaseKeeper",
    "LeaseTerms",
    "keep_async",
]

log = logging.getLogger("idemq.guard")

MAX_RENEWALS_IN_FLIGHT = 16
"""How many renewals one sync guard has out at once; more wait for one to answer. A bound, so
that a store gone silent ties up at most this many threads and pooled connections."""


@dataclass(slots=True)  # not frozen: one per lease-mode message (see flow.Claim)
class LeaseTerms:
    """The claim a running handler holds: whose, and for how long each renewal extends it."""

    key: Key
    owner: str
    lease_ms: int

    @property
    def interval_s(self) -> float:
        """How often the claim is renewed: a third of the lease, so two renewals may fail."""
        return self.lease_ms / 3000

    @property
    def lost_after_s(self) -> float:
        """How long after the last confirmed renewal was sent the claim counts as lost: the
        lease less a tenth, so the handler hears of it before a rival can take over."""
        return self.lease_ms * 0.9 / 1000


@dataclass(slots=True, eq=False)
class Kept:
    """One claim a :class:`LeaseKeeper` renews (see :meth:`LeaseKeeper.keep`)."""

    terms: LeaseTerms
    context: HandlerContext | None  # None: a claim held for a later handler of a batch
    next_at: float  # monotonic: when the next renewal is due
    confirmed_at: float  # monotonic: when the last confirmed renewal (or the claim) was sent
    renewing: bool = False  # a renewal is out; no other starts for this claim until it answers
    gone: bool = False  # the store said the claim is no longer ours: no more renewals

    @property
    def lost_at(self) -> float:
        return self.confirmed_at + self.terms.lost_after_s


RenewCall = Callable[[Key, str, int, int], bool]
"""``store.renew(key, owner, lease_until_ms, now_ms) -> still held``."""


def _mark_lost(kept: Kept) -> None:
    """Tell ``kept``'s handler its claim is lost (once); a held claim just stops renewing."""
    kept.gone = True
    context = kept.context
    if context is None or context.lease_lost:
        return
    log.warning(
        "idemq lease lost while its handler ran: %s (%s)",
        kept.terms.key.message_id,
        kept.terms.key.consumer,
    )
    context.mark_lease_lost()


def _answered(kept: Kept, held: bool | None, sent_at: float) -> None:
    """What one renewal's answer means (None: the store could not be reached in time)."""
    if held:
        kept.confirmed_at = max(kept.confirmed_at, sent_at)
    elif held is False:
        _mark_lost(kept)


def _overdue(kept: Kept, now: float) -> None:
    """No renewal confirmed for ``lost_after_s``: the claim may have been taken over."""
    if kept.context is not None and not kept.gone and now >= kept.lost_at:
        _mark_lost(kept)


@dataclass(eq=False)
class LeaseKeeper:
    """Renews the claims of a sync guard's running handlers (and of the later messages a batch
    holds), from one scheduling thread of its own and a short-lived thread per renewal.

    The scheduling thread starts with the first claim to keep and ends once none was kept for
    ``idle_exit_s``, so an idle guard holds no thread. It never calls the store itself: it
    starts renewals when due and, whatever they are doing, reports a handler's claim lost once
    no renewal was confirmed for :attr:`LeaseTerms.lost_after_s`.
    """

    renew: RenewCall
    clock: Clock
    monotonic: Callable[[], float] = time.monotonic
    idle_exit_s: float = 10.0
    max_in_flight: int = MAX_RENEWALS_IN_FLIGHT
    _kept: set[Kept] = field(default_factory=set)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    _in_flight: int = 0
    _idle_since: float = 0.0
    # When the scheduling thread wakes by itself next (monotonic; it waits until then): a claim
    # due no sooner need not wake it, so a stream of short handlers costs no thread switch each.
    _wakes_at: float = 0.0

    def keep(self, terms: LeaseTerms, context: HandlerContext) -> Kept:
        """Renew ``terms``' claim from now until :meth:`stop` (``context`` hears if it is lost);
        the guard calls ``stop`` in the ``finally`` around the handler."""
        return self._add(terms, context)

    def stop(self, kept: Kept) -> None:
        """Stop renewing a claim :meth:`keep` returned."""
        self._discard((kept,))

    @contextmanager
    def holding(self) -> Iterator[Holding]:
        """Claims held for later handlers (a lease-mode batch), renewed until :meth:`Holding.keep`
        leaves them out or the block ends."""
        holding = Holding(self)
        try:
            yield holding
        finally:
            holding.keep(())

    def _add(self, terms: LeaseTerms, context: HandlerContext | None) -> Kept:
        now = self.monotonic()
        kept = Kept(terms, context, now + terms.interval_s, now)
        with self._cond:
            self._kept.add(kept)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idemq-lease-keeper", daemon=True
                )
                self._thread.start()
            elif kept.next_at < self._wakes_at:  # due before the thread looks again
                self._cond.notify()
        return kept

    def _discard(self, kept: Iterable[Kept]) -> None:
        with self._cond:
            for one in kept:
                self._kept.discard(one)
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
                    self._wait_until(now + self.idle_exit_s, now)
                    continue
                due = self._due(now)
                if not due:
                    self._wait_until(max(self._next_wake(now), now + 0.001), now)
                    continue
            for kept in due:  # outside the lock: starting a thread must not block keep()
                threading.Thread(
                    target=self._renew_once, args=(kept,), name="idemq-lease-renewal", daemon=True
                ).start()

    def _wait_until(self, wake: float, now: float) -> None:
        """Sleep (the lock released) until ``wake``, or until :meth:`_add` or a renewal's
        answer notifies; under the lock."""
        self._wakes_at = wake
        self._cond.wait(wake - now)
        self._wakes_at = 0.0  # awake: whatever is added now is seen before the next wait

    def _due(self, now: float) -> list[Kept]:
        """Report overdue claims lost; take the renewals due now (under the lock)."""
        due: list[Kept] = []
        for kept in self._kept:
            _overdue(kept, now)
        for kept in self._kept:
            if kept.gone or kept.renewing or kept.next_at > now:
                continue
            if self._in_flight >= self.max_in_flight:
                break
            kept.renewing = True
            kept.next_at = now + kept.terms.interval_s
            self._in_flight += 1
            due.append(kept)
        return due

    def _next_wake(self, now: float) -> float:
        wake = now + self.idle_exit_s
        for kept in self._kept:
            if kept.gone:
                continue
            if not kept.renewing and self._in_flight < self.max_in_flight:
                wake = min(wake, kept.next_at)
            if kept.context is not None:
                wake = min(wake, kept.lost_at)
        return wake

    def _renew_once(self, kept: Kept) -> None:
        terms = kept.terms
        sent_at = self.monotonic()
        now_ms = self.clock()
        held: bool | None
        try:
            held = bool(self.renew(terms.key, terms.owner, now_ms + terms.lease_ms, now_ms))
        except StoreError as exc:
            log.warning("idemq lease renewal of %s failed: %s", terms.key.message_id, exc)
            held = None
        with self._cond:
            self._in_flight -= 1
            kept.renewing = False
            if kept in self._kept:  # not a handler that finished meanwhile
                _answered(kept, held, sent_at)
            self._cond.notify()  # a renewal held back by max_in_flight may start now


class Holding:
    """The claims a lease-mode batch holds for its later messages (see
    :meth:`LeaseKeeper.holding`)."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self._keeper = keeper
        self._held: list[Kept] = []  # in the batch's order

    def keep(self, terms: Sequence[LeaseTerms]) -> None:
        """Hold exactly ``terms``' claims from now on: new ones are renewed from now, the ones
        left out (their handler starts now, or they are settled) are no longer renewed here.

        A batch passes the same claims each time, fewer at the front (a tail of one tuple), so
        that case only drops the front: no work per held claim for every handler started."""
        held, count = self._held, len(terms)
        start = len(held) - count
        if start >= 0 and (count == 0 or held[start].terms is terms[0]):
            if start:
                self._keeper._discard(held[:start])
                del held[:start]
            return
        self._keeper._discard(held)
        self._held = [self._keeper._add(one, None) for one in terms]


async def keep_async(
    renew: Callable[[Key, str, int, int], Any],
    clock: Clock,
    terms: LeaseTerms,
    context: HandlerContext,
    handler: asyncio.Future[Any],
    *,
    monotonic: Callable[[], float] = time.monotonic,
    kept_since: float | None = None,
) -> None:
    """Renew ``terms``' claim every ``interval_s`` until cancelled; when the claim is lost —
    refused, or no renewal confirmed for ``lost_after_s`` — cancel ``handler`` (the task the
    handler runs in), after marking ``context``, with no await in between: whoever catches the
    cancel can tell it from another by ``context.lease_lost``.

    ``kept_since``: when (``monotonic``) the claim was made or last confirmed, if before now:
    a guard starts this loop only once the first renewal is due (see :class:`AsyncKeeping`).

    A renewal runs as a task of its own that this loop waits on only until the claim would
    count as lost: a renewal stuck on a silent connection (and, after a cancel, a driver still
    waiting to hear that its query was cancelled) cannot hold the verdict back.
    """
    now = monotonic() if kept_since is None else kept_since
    kept = Kept(terms, context, now + terms.interval_s, now)
    pending: asyncio.Future[Any] | None = None
    sent_at = now
    try:
        while True:
            now = monotonic()
            _overdue(kept, now)
            if kept.gone:
                break
            if pending is None and now >= kept.next_at:
                kept.next_at = now + terms.interval_s
                sent_at, now_ms = now, clock()
                pending = asyncio.ensure_future(
                    renew(terms.key, terms.owner, now_ms + terms.lease_ms, now_ms)
                )
            if pending is None:
                await asyncio.sleep(min(kept.next_at, kept.lost_at) - now)
                continue
            done, _ = await asyncio.wait({pending}, timeout=max(kept.lost_at - now, 0.001))
            if pending in done:
                _answered(kept, _renewal_answer(pending, terms), sent_at)
                pending = None
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # not awaited: the driver may take long to give it up
    handler.cancel()


class AsyncKeeping:
    """:func:`keep_async` for one running async handler's claim, its task started only when the
    first renewal is due (``interval_s`` from now); :meth:`stop` it when the handler is done.

    Nothing can happen to the claim before then (it counts as lost no sooner than
    ``lost_after_s``, after the first renewal), and most handlers are done long before: they
    cost a timer, not a task that is started and cancelled again.
    """

    __slots__ = ("_args", "_keeper", "_since", "_timer")

    def __init__(
        self,
        renew: Callable[[Key, str, int, int], Any],
        clock: Clock,
        terms: LeaseTerms,
        context: HandlerContext,
        handler: asyncio.Future[Any],
    ) -> None:
        self._args = (renew, clock, terms, context, handler)
        self._since = time.monotonic()
        self._keeper: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(terms.interval_s, self._start)

    def _start(self) -> None:
        self._keeper = asyncio.ensure_future(keep_async(*self._args, kept_since=self._since))

    def stop(self) -> None:
        """No more renewals (the handler is done, or was cancelled)."""
        self._timer.cancel()
        if self._keeper is not None:
            self._keeper.cancel()


def _renewal_answer(renewal: asyncio.Future[Any], terms: LeaseTerms) -> bool | None:
    """A finished renewal's answer: held or not, or None when the store failed."""
    error = renewal.exception()
    if error is None:
        return bool(renewal.result())
    if isinstance(error, StoreError):
        log.warning("idemq lease renewal of %s failed: %s", terms.key.message_id, error)
        return None
    raise error


class AsyncHolding:
    """:class:`Holding` for an async guard: a task per held claim, renewing it every
    ``interval_s`` until its handler's turn comes (or the batch ends: :meth:`close`)."""

    def __init__(self, renew: Callable[[Key, str, int, int], Any], clock: Clock) -> None:
        self._renew = renew
        self._clock = clock
        self._held: list[tuple[LeaseTerms, asyncio.Task[None]]] = []  # in the batch's order

    def keep(self, terms: Sequence[LeaseTerms]) -> None:
        """See :meth:`Holding.keep`."""
        held, count = self._held, len(terms)
        start = len(held) - count
        if start >= 0 and (count == 0 or held[start][0] is terms[0]):
            for _terms, task in held[:start]:
                task.cancel()
            del held[:start]
            return
        for _terms, task in held:
            task.cancel()
        self._held = [(one, asyncio.create_task(self._hold(one))) for one in terms]

    def close(self) -> None:
        """Stop renewing every held claim."""
        self.keep(())

    async def _hold(self, terms: LeaseTerms) -> None:
        # No handler to tell: the batch renews this claim once more before its handler starts
        # (batch_flow's Renew step), and that answer alone decides whether it runs.
        while True:
            await asyncio.sleep(terms.interval_s)
            now_ms = self._clock()
            try:
                held = await asyncio.wait_for(
                    self._renew(terms.key, terms.owner, now_ms + terms.lease_ms, now_ms),
                    terms.lost_after_s,
                )
            except (TimeoutError, StoreError) as exc:
                log.warning("idemq lease renewal of %s failed: %r", terms.key.message_id, exc)
                continue
            if not held:
                return
