"""What a handler can know about the message it is running for, without being passed it.

While a guard runs a handler, :func:`current_message` returns the :class:`HandlerContext` of that
run: the consumer, the message id, the claim's owner token and fencing token, and whether its
lease was lost.
Code deep inside the handler — an outbox ``add``, a call to another service that should carry
the message id on — reads it from here instead of threading it through every signature.
Outside a guarded handler it is ``None``.

It lives in a :class:`contextvars.ContextVar`, so each thread and each asyncio task sees its own:
two handlers running side by side never see each other's message.
"""

from __future__ import annotations

import itertools
import threading
from contextvars import ContextVar, Token
from dataclasses import dataclass, field

__all__ = ["HandlerContext", "current_message", "enter", "leave"]


@dataclass(frozen=True, slots=True)
class HandlerContext:
    """One run of a handler for one message.

    ``fence``: the claim's fencing token (lease mode): an int that is greater for every later
    owner of the same message id — a takeover after this run's lease ran out gets a greater one
    — so a write fenced with it (``StateMachine.apply(..., fence=)``,
    ``versioned_update(..., fence=)``, or a downstream service's own check) is refused once a
    later owner has written. It is the store's clock in epoch microseconds at the winning claim
    (see :class:`idemq.stores.base.Claim`); None in transactional mode, where the dedup row
    shares the business transaction and no second owner can exist, and for batch claims on SQL.

    ``next_index()`` numbers things the handler makes (outgoing messages, say) 0, 1, 2 … in the
    order it makes them. A run that is rolled back and runs again (a redelivery, a batch's
    isolated pass) starts again from 0, so what it derives from the numbers comes out the same.
    """

    consumer: str
    message_id: str
    owner: str
    fence: int | None = None
    _counter: itertools.count[int] = field(default_factory=itertools.count, repr=False)
    # Made on first use (a lost lease, or a handler that waits for one): nearly every run ends
    # without either, and an Event (a Condition and its lock) is most of what a context costs.
    _lost: threading.Event | None = field(default=None, repr=False)

    def next_index(self) -> int:
        """The next number of this run (0 for the first call)."""
        return next(self._counter)

    @property
    def lease_lost(self) -> bool:
        """True once a renewal found this run's claim taken over or gone (lease mode): the
        effect must not be made now, or only through a guard that refuses a stale owner."""
        lost = self._lost
        return lost is not None and lost.is_set()

    def wait_lease_lost(self, timeout_s: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout_s`` passed; True when it was lost."""
        return self._lost_event().wait(timeout_s)

    def mark_lease_lost(self) -> None:
        """Say the claim is lost (the guard's renewal calls this)."""
        self._lost_event().set()

    def _lost_event(self) -> threading.Event:
        lost = self._lost
        if lost is None:
            # Under a lock: the renewal's thread marking the loss and the handler starting to
            # wait for it may both come first, and they must share one Event.
            with _LOST_EVENT_LOCK:
                lost = self._lost
                if lost is None:
                    lost = threading.Event()
                    # The documented way to set a field of a frozen dataclass (as in its
                    # __post_init__): the context stays read-only to the handler.
                    object.__setattr__(self, "_lost", lost)
        return lost


_LOST_EVENT_LOCK = threading.Lock()


_CURRENT: ContextVar[HandlerContext | None] = ContextVar("idemq_handler_context", default=None)


def current_message() -> HandlerContext | None:
    """The message whose handler is running in this thread or task, or ``None``."""
    return _CURRENT.get()


def enter(context: HandlerContext) -> Token[HandlerContext | None]:
    """Make ``context`` current (the guard's shells call this around a handler)."""
    return _CURRENT.set(context)


def leave(token: Token[HandlerContext | None]) -> None:
    """Undo :func:`enter`."""
    _CURRENT.reset(token)
