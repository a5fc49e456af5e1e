"""Waiting duplicates inside one process: a duplicate of a message this very guard is running
waits for that call instead of polling the store.

Lease mode with ``wait_s``: without this, each of 49 coroutines that meet the claim of a fiftieth
claims again with backoff, so every waiting duplicate costs the store a claim per pause and
hears of the result only at its next pause. With it, only the first call of a message id goes
to the store; calls of the same id that arrive on the same guard while it runs wait on an
:class:`asyncio.Event` and are answered from its outcome::

    call 1   claim → handler → complete → PROCESSED        (sets the event)
    call 2   same id in flight → waits on the event → DUPLICATE, call 1's result
    call 3   same id in flight → its payload differs → PayloadMismatchError at once

Only what the store already holds as done is answered this way: the first call came back
PROCESSED (its lease completed) or DUPLICATE (the store's record). When it raised (handler error,
lost lease, store outage) or gave up waiting (IN_PROGRESS), the waiters go to the store as
usual for the rest of their wait, so a failed first call never stands for a result. A waiter
that meets no result within ``wait_s`` is answered by the store too (one claim: it may find the
message done or its lease expired). One registry belongs to one guard, so to one consumer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from idemq.errors import PayloadMismatchError
from idemq.guard.core import Outcome, Policy, Status, processed_record
from idemq.stores.base import ClaimRequest, Record

__all__ = ["InFlight", "Running"]


@dataclass(slots=True)
class Running:
    """One message id's call in flight on this guard, and what it came to once it is done."""

    request: ClaimRequest
    done: asyncio.Event = field(default_factory=asyncio.Event)
    record: Record | None = None  # set when the call ended with the message done in the store


class InFlight:
    """The calls in flight on one async guard, by message id (one event loop's coroutines)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._running: dict[str, Running] = {}

    def holder(self, request: ClaimRequest) -> Running | None:
        """The call already running ``request``'s message id, or None: then ``request``'s call
        is registered as running it, and must :meth:`finish`."""
        message_id = request.key.message_id
        running = self._running.get(message_id)
        if running is None:
            self._running[message_id] = Running(request)
            return None
        first, mine = running.request.payload_hash, request.payload_hash
        if first is not None and mine is not None and first != mine:
            raise PayloadMismatchError(message_id, first, mine)
        return running

    def finish(self, request: ClaimRequest, outcome: Outcome[Any] | None) -> None:
        """``request``'s call ended: ``outcome``, or None when it raised. Wakes its waiters."""
        running = self._running.pop(request.key.message_id)
        running.record = self._done_record(request, outcome)
        running.done.set()

    async def wait(self, running: Running, request: ClaimRequest) -> Outcome[Any] | None:
        """Wait up to the guard's ``wait_s`` for ``running`` to end: a DUPLICATE answered with
        its result, or None when it ended otherwise or not in time (ask the store)."""
        try:
            await asyncio.wait_for(running.done.wait(), self.policy.wait_ms / 1000)
        except TimeoutError:
            return None
        record = running.record
        if record is None:
            return None
        message_id = request.key.message_id
        return Outcome(Status.DUPLICATE, message_id, self.policy.decode(record.result), record)

    def _done_record(self, request: ClaimRequest, outcome: Outcome[Any] | None) -> Record | None:
        """The store's record of a call that ended with the message done, else None."""
        if outcome is None:
            return None
        if outcome.status is Status.DUPLICATE:
            return outcome.record
        if outcome.status is Status.PROCESSED:
            return processed_record(self.policy, request, outcome.result)
        return None
