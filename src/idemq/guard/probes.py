"""The guard's hooks: what an observer is told about each message, and how the shells tell it.

The guards hold ``observer=None`` by default and check it once per
message; only when an observer is set do they ask it for a :class:`Probe` and report each stage
to it::

    probe = observer.begin(consumer, message_id)   # just before the claim
    probe.claimed(status)            # claim answered: None = won (the handler runs next),
                                     # else DUPLICATE / IN_PROGRESS
    probe.handler_started()          # (only when the claim was won)
    probe.handler_done(error)        # error: the handler's exception or None
    probe.finished(outcome, error)   # after complete/commit; exactly one of the two is set

Write an observer by subclassing :class:`Observer` and overriding the plain callbacks
(``claim_done``, ``handler_done``, ``finished``, ``dead_lettered``) — durations arrive measured —
or override :meth:`Observer.begin` when you need the stage boundaries themselves (tracing does,
to make the handler's span current while it runs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from idemq.guard.core import Outcome, Status
from idemq.stores.base import Claim, RecordStatus

T = TypeVar("T")


class Probe(Protocol):
    """One message's journey through the guard, reported stage by stage."""

    def claimed(self, status: Status | None) -> None: ...

    def handler_started(self) -> None: ...

    def handler_done(self, error: BaseException | None) -> None: ...

    def finished(self, outcome: Outcome[Any] | None, error: BaseException | None) -> None: ...


class Observer:
    """Base class of observers; every callback is a no-op until overridden.

    ``begin`` returns a :class:`TimingProbe` that measures the stages with a monotonic clock and
    calls the plain callbacks below, so most observers only override those.
    """

    def begin(self, consumer: str, message_id: str) -> Probe:
        """Called once per message, right before its claim."""
        return TimingProbe(self, consumer, message_id)

    def claim_done(
        self, consumer: str, message_id: str, seconds: float, status: Status | None
    ) -> None:
        """The claim took ``seconds``; ``status`` None = won, else DUPLICATE/IN_PROGRESS."""

    def handler_done(
        self, consumer: str, message_id: str, seconds: float, error: BaseException | None
    ) -> None:
        """The handler ran for ``seconds``; ``error`` is what it raised, or None."""

    def finished(
        self,
        consumer: str,
        message_id: str,
        seconds: float,
        outcome: Outcome[Any] | None,
        error: BaseException | None,
    ) -> None:
        """The guard returned ``outcome`` or raised ``error``, ``seconds`` after the claim began."""

    def dead_lettered(self, consumer: str, message_id: str, reason: str) -> None:
        """The worker dead-lettered the message (called by ``idemq worker``, not the guard)."""


class TimingProbe:
    """Measures each stage with ``time.perf_counter`` and reports to an :class:`Observer`."""

    __slots__ = ("_consumer", "_message_id", "_observer", "_t_begin", "_t_handler")

    def __init__(self, observer: Observer, consumer: str, message_id: str) -> None:
        self._observer = observer
        self._consumer = consumer
        self._message_id = message_id
        self._t_begin = self._t_handler = time.perf_counter()

    def claimed(self, status: Status | None) -> None:
        """Report the claim's latency and answer."""
        seconds = time.perf_counter() - self._t_begin
        self._observer.claim_done(self._consumer, self._message_id, seconds, status)

    def handler_started(self) -> None:
        """Start the handler's stopwatch."""
        self._t_handler = time.perf_counter()

    def handler_done(self, error: BaseException | None) -> None:
        """Report the handler's duration and error."""
        seconds = time.perf_counter() - self._t_handler
        self._observer.handler_done(self._consumer, self._message_id, seconds, error)

    def finished(self, outcome: Outcome[Any] | None, error: BaseException | None) -> None:
        """Report the end result."""
        seconds = time.perf_counter() - self._t_begin
        self._observer.finished(self._consumer, self._message_id, seconds, outcome, error)


class _FanOut:
    """The probes of several observers, driven as one."""

    __slots__ = ("_probes",)

    def __init__(self, probes: Sequence[Probe]) -> None:
        self._probes = probes

    def claimed(self, status: Status | None) -> None:
        for probe in self._probes:
            probe.claimed(status)

    def handler_started(self) -> None:
        for probe in self._probes:
            probe.handler_started()

    def handler_done(self, error: BaseException | None) -> None:
        for probe in self._probes:
            probe.handler_done(error)

    def finished(self, outcome: Outcome[Any] | None, error: BaseException | None) -> None:
        for probe in self._probes:
            probe.finished(outcome, error)


class CompositeObserver(Observer):
    """Several observers at once, e.g. ``CompositeObserver(PrometheusObserver(), OtelObserver())``.

    Each sees every stage in the order given.
    """

    def __init__(self, *observers: Observer) -> None:
        self.observers = tuple(observers)

    def begin(self, consumer: str, message_id: str) -> Probe:
        """One probe per observer, fanned out."""
        return _FanOut([o.begin(consumer, message_id) for o in self.observers])

    def dead_lettered(self, consumer: str, message_id: str, reason: str) -> None:
        """Tell every observer."""
        for observer in self.observers:
            observer.dead_lettered(consumer, message_id, reason)


def claim_status(claim: Claim) -> Status | None:
    """What a claim means, for the probe: None = won, else DUPLICATE or IN_PROGRESS."""
    if claim.acquired:
        return None
    record = claim.record
    if record is not None and record.status is RecordStatus.PROCESSED:
        return Status.DUPLICATE
    return Status.IN_PROGRESS


def report_batch(observer: Observer, consumer: str, outcomes: Sequence[Outcome[Any]]) -> None:
    """``process_batch`` reports each message's end result (no per-message claim latency: the
    batch was claimed in one round trip)."""
    for outcome in outcomes:
        observer.begin(consumer, outcome.message_id).finished(outcome, None)
