"""One message through the guard, as steps: claim, judge, handle, then save and commit, complete,
or release. No I/O happens here; the sync and async shells carry each step out.

Transactional mode — the shell opens the transaction and runs the flow inside it::

    ClaimIn        INSERT the dedup row as PROCESSED; a concurrent twin waits on its row lock
    (judge)        an existing row → DUPLICATE (result replayed) or IN_PROGRESS, nothing written
    RunHandler     handler(tx): the business writes, through the same connection
    ConfirmIn      prove the transaction still holds the dedup row (and store the result):
                   a handler that caught a database error may have lost it (see ConfirmIn)
    —              the shell commits: dedup row and effect become visible together, or neither

Lease mode (any store)::

    Claim          PROCESSING with owner token and lease expiry (or take over an expired lease)
    (judge)
    RunHandler     handler(None)
    Complete       PROCESSED with its result; refused (LeaseLostError) if the lease was taken over
    Release        instead, when the handler raised: the message can be retried at once

Each step names the store primitive it stands for and calls it (:meth:`StoreStep.call`): for
a sync store the call returns the answer, for an async store an awaitable of it, so one step
type serves both shells. The handler is the one step a shell runs itself
(:class:`RunHandler`), because only the shell knows whether to await it; its outcome comes back
as data — ``(True, result)`` or ``(False, exception)`` — so the flow, not the shell, decides
what a failure means (release the lease, roll the batch back, mark one message FAILED).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from idemq._backoff import Backoff
from idemq.errors import IdemqError, ResultNotSerializableError, StoreConflictError
from idemq.guard.cache import CompletedCache
from idemq.guard.codec import NULL_RESULT
from idemq.guard.context import HandlerContext
from idemq.guard.core import CLAIM_ATTEMPTS, Mode, Outcome, Policy, Status, judge
from idemq.guard.probes import Probe, claim_status
from idemq.guard.renewal import LeaseTerms
from idemq.stores.base import Claim as StoredClaim
from idemq.stores.base import ClaimRequest, Key

__all__ = [
    "Claim",
    "ClaimIn",
    "ClaimMany",
    "ClaimManyIn",
    "CloseSavepoint",
    "Complete",
    "ConfirmIn",
    "ConfirmManyIn",
    "ConflictRetries",
    "Flow",
    "HandlerFailureIn",
    "HandlerRun",
    "OpenSavepoint",
    "Pause",
    "Release",
    "ReleaseIn",
    "Renew",
    "RunHandler",
    "Step",
    "StoreStep",
    "message_flow",
    "raise_if_transaction_lost",
    "release_noting_failure",
    "run_handler",
]


class StoreStep:
    """A step that is one call of a store primitive; ``tx`` is the open transaction or None."""

    __slots__ = ()

    def call(self, store: Any, tx: Any) -> Any:
        """Call the primitive on ``store`` (returns an awaitable for an async store)."""
        raise NotImplementedError


# The steps of a single message (Claim, Complete, Release, RunHandler, HandlerRun) are made for
# every message, so they are not frozen: a frozen dataclass sets each field through
# object.__setattr__. A step lives only between the flow that yields it and the shell that
# carries it out, so nothing can share and mutate one.
@dataclass(slots=True)
class Claim(StoreStep):
    """Lease mode: claim one message. Reply: :class:`~idemq.stores.base.Claim`."""

    request: ClaimRequest

    def call(self, store: Any, tx: Any) -> Any:
        return store.claim(self.request)


@dataclass(frozen=True, slots=True)
class ClaimMany(StoreStep):
    """Lease mode: claim a batch in one round trip. Reply: a claim per request, in order."""

    requests: Sequence[ClaimRequest]

    def call(self, store: Any, tx: Any) -> Any:
        return store.claim_many(self.requests)


@dataclass(slots=True)
class Complete(StoreStep):
    """Lease mode: PROCESSING → PROCESSED with ``result``; raises LeaseLostError if lost."""

    key: Key
    owner: str
    result: str
    now_ms: int

    def call(self, store: Any, tx: Any) -> Any:
        return store.complete(self.key, self.owner, self.result, self.now_ms)


@dataclass(slots=True)
class Release(StoreStep):
    """Lease mode: delete the owner's PROCESSING record so the message can run again."""

    key: Key
    owner: str

    def call(self, store: Any, tx: Any) -> Any:
        return store.release(self.key, self.owner)


@dataclass(frozen=True, slots=True)
class Renew(StoreStep):
    """Lease mode: extend ``owner``'s claim to ``now_ms`` plus ``lease_ms``. Reply: True while
    ``owner`` still holds it, False once it was taken over, released or completed.

    A batch sends it right before each later message's handler: the claim was made with the
    batch, and only a store that says it is still ours proves no rival has taken it since.
    """

    key: Key
    owner: str
    lease_ms: int
    now_ms: int

    def call(self, store: Any, tx: Any) -> Any:
        return store.renew(self.key, self.owner, self.now_ms + self.lease_ms, self.now_ms)


@dataclass(frozen=True, slots=True)
class ClaimIn(StoreStep):
    """Transactional: insert the dedup row inside ``tx``. Reply: a claim."""

    request: ClaimRequest

    def call(self, store: Any, tx: Any) -> Any:
        return store.claim_in(tx, self.request)


@dataclass(frozen=True, slots=True)
class ClaimManyIn(StoreStep):
    """Transactional: insert a batch's dedup rows inside ``tx``. Reply: a claim per request."""

    requests: Sequence[ClaimRequest]

    def call(self, store: Any, tx: Any) -> Any:
        return store.claim_many_in(tx, self.requests)


@dataclass(frozen=True, slots=True)
class ConfirmIn(StoreStep):
    """Transactional: right before the COMMIT, prove that ``tx`` still holds the dedup row
    ``owner`` claimed, storing ``result`` on it; raises :class:`~idemq.TransactionLostError`
    when it does not.

    Without it, a handler that caught a database error would be answered PROCESSED and its
    message acknowledged while nothing of it commits: PostgreSQL aborts the transaction at the
    failed statement and its COMMIT silently rolls back (effect and dedup row lost); InnoDB
    rolls a deadlocked transaction back and the handler's later statements commit in a new one
    without the dedup row (the redelivery applies the effect again). ``deferred``: a batch's
    :class:`ConfirmManyIn` proves the row later, so only a free check is made now.
    """

    key: Key
    owner: str
    result: str
    deferred: bool = False

    def call(self, store: Any, tx: Any) -> Any:
        return store.confirm_in(tx, self.key, self.owner, self.result, deferred=self.deferred)


@dataclass(frozen=True, slots=True)
class ConfirmManyIn(StoreStep):
    """Transactional batch: :class:`ConfirmIn` for every PROCESSED message of the pass at once
    (one read, or none where the driver's transaction status is proof)."""

    requests: Sequence[ClaimRequest]

    def call(self, store: Any, tx: Any) -> Any:
        return store.confirm_many_in(tx, self.requests)


@dataclass(frozen=True, slots=True)
class ReleaseIn(StoreStep):
    """Transactional batch: delete the dedup row of a message whose handler failed."""

    key: Key
    owner: str

    def call(self, store: Any, tx: Any) -> Any:
        return store.release_in(tx, self.key, self.owner)


@dataclass(frozen=True, slots=True)
class HandlerFailureIn(StoreStep):
    """Transactional: what a handler's exception means for the transaction it ran in.

    Reply: the store error it stands for when the transaction is gone — a deadlock or lock
    timeout rolled it back whole, the connection dropped — or None (the handler's own error).
    A transaction that is gone cannot go on: its earlier writes are lost, so carrying on would
    answer PROCESSED for effects never committed, or commit later effects without their dedup
    rows.
    """

    error: BaseException

    def call(self, store: Any, tx: Any) -> Any:
        return store.translate_handler_error(tx, self.error)


@dataclass(frozen=True, slots=True)
class OpenSavepoint(StoreStep):
    """Transactional batch: a SAVEPOINT for one message's writes. Reply: the savepoint."""

    def call(self, store: Any, tx: Any) -> Any:
        return store.begin_savepoint(tx)


@dataclass(frozen=True, slots=True)
class CloseSavepoint(StoreStep):
    """Release the savepoint (``commit``) or roll the message's writes back to it."""

    savepoint: Any
    commit: bool

    def call(self, store: Any, tx: Any) -> Any:
        return store.end_savepoint(self.savepoint, commit=self.commit)


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds`` before the next step (a duplicate waiting for a live claim to finish)."""

    seconds: float


@dataclass(slots=True)
class RunHandler:
    """Run the handler for ``message`` (None for :meth:`~idemq.Idempotency.process`), with
    ``context`` current (:func:`idemq.guard.context.current_message`) while it runs.

    The shell replies ``(True, result)``, or ``(False, exception)`` when the handler raised —
    anything at all, ``KeyboardInterrupt`` and task cancellation included, so that the flow can
    still release a lease or undo a batch message's claim before the error goes on.
    """

    message: Any
    context: HandlerContext
    lease: LeaseTerms | None = None  # lease mode: the claim to renew while the handler runs
    # Lease-mode batch: the claims held for its later messages, renewed while this one runs.
    held: tuple[LeaseTerms, ...] = ()


Step: TypeAlias = StoreStep | RunHandler | Pause
Flow: TypeAlias = Generator[Step, Any, Any]


@dataclass(slots=True)
class HandlerRun:
    """What one run of the handler gave: its result and the result's stored form, or an error."""

    result: Any = None
    encoded: str = NULL_RESULT
    error: BaseException | None = None


def run_handler(
    policy: Policy,
    request: ClaimRequest,
    message: Any,
    probe: Probe | None,
    fence: int | None = None,
    *,
    held: tuple[LeaseTerms, ...] = (),
) -> Generator[Step, Any, HandlerRun]:
    """The handler step, reported to ``probe`` (``held``: see :attr:`RunHandler.held`).

    A result that cannot be stored counts as the handler's failure, found before anything is
    written: a message must never be answered PROCESSED with a result no duplicate can replay.
    """
    if probe is not None:
        probe.handler_started()
    key = request.key
    # The fence is a lease's: in transactional mode nothing can take the message over.
    fenced = None if policy.mode is Mode.TRANSACTIONAL else fence
    context = HandlerContext(key.consumer, key.message_id, request.owner, fenced)
    lease = LeaseTerms(key, request.owner, policy.lease_ms) if policy.renews else None
    ok, value = yield RunHandler(message, context, lease, held)
    if probe is not None:
        probe.handler_done(None if ok else value)
    if not ok:
        return HandlerRun(error=value)
    try:
        return HandlerRun(value, policy.encode(value))
    except ResultNotSerializableError as exc:
        return HandlerRun(error=exc)


def raise_if_transaction_lost(error: BaseException) -> Generator[Step, Any, None]:
    """Raise the store error ``error`` stands for if the transaction it ran in is gone (see
    :class:`HandlerFailureIn`): a conflict then reruns the whole transaction, an outage is
    retried later — neither is counted against the message."""
    if isinstance(error, Exception) and not isinstance(error, IdemqError):  # a driver's, maybe
        lost = yield HandlerFailureIn(error)
        if lost is not None:
            raise lost from error


def release_noting_failure(request: ClaimRequest, cause: BaseException) -> Flow:
    """Release the lease of a handler that raised ``cause``; a failed release is noted on it.

    The lease expires by itself anyway, so the handler's error is the one to surface.
    """
    try:
        yield Release(request.key, request.owner)
    except Exception as exc:
        cause.add_note(f"idemq: releasing the claim failed too ({exc!r}); it will expire")


def message_flow(
    policy: Policy,
    request: ClaimRequest,
    probe: Probe | None,
    cache: CompletedCache | None = None,
    wait_until_ms: int | None = None,
) -> Flow:
    """One message, in the guard's mode; returns its :class:`Outcome` or raises.

    In transactional mode the shell runs this inside the transaction it opened: a handler error
    raised from here rolls the dedup row back with the effect, and a DUPLICATE or IN_PROGRESS
    returned from here commits nothing but a lock that is released. ``cache``: completed records
    answered without a claim (see :mod:`idemq.guard.cache`). ``wait_until_ms``: when a waiting
    duplicate stops waiting (default: ``wait_s`` after the request was made).
    """
    transactional = policy.mode is Mode.TRANSACTIONAL
    cached = None if cache is None else cache.get(request.key.message_id, request.now_ms)
    if cached is not None:
        claim = StoredClaim.lost_to(cached)
    elif transactional:
        claim = yield ClaimIn(request)  # a conflict reruns the transaction (ConflictRetries)
    else:
        try:
            claim = yield Claim(request)
        except StoreConflictError:
            # The store ran its claim again and again, and each time a concurrent transaction
            # on the same record (a twin's claim, a takeover, a complete) rolled it back:
            # nothing was written, and someone else is handling the message. Not acked, and
            # not counted against it as a failure: it comes back later and meets that record.
            return Outcome(Status.IN_PROGRESS, request.key.message_id)
    if probe is not None:
        probe.claimed(claim_status(claim))
    judged = judge(policy, request, claim)
    if judged is not None and judged.status is Status.IN_PROGRESS and policy.wait_ms > 0:
        until_ms = request.now_ms + policy.wait_ms if wait_until_ms is None else wait_until_ms
        judged, request, claim = yield from _wait_for_holder(
            policy, request, judged, claim, until_ms
        )
    if judged is not None:
        return judged
    run = yield from run_handler(policy, request, None, probe, claim.fence)
    if run.error is not None:
        if transactional:
            yield from raise_if_transaction_lost(run.error)
        else:
            yield from release_noting_failure(request, run.error)
        raise run.error
    if transactional:
        yield ConfirmIn(request.key, request.owner, run.encoded)
    else:
        yield Complete(request.key, request.owner, run.encoded, policy.clock())
    return Outcome.processed(request.key.message_id, run.result)


def _wait_for_holder(
    policy: Policy,
    request: ClaimRequest,
    judged: Outcome[Any],
    claim: StoredClaim,
    deadline_ms: int,
) -> Generator[Step, Any, tuple[Outcome[Any] | None, ClaimRequest, StoredClaim]]:
    """A duplicate that met a live claim (lease mode) claims again, backing off, until the
    holder finished (DUPLICATE, its result replayed), its lease ran out and this claim took it
    over (None: run the handler), or ``deadline_ms`` passed (still IN_PROGRESS); returns the
    last claim too (a takeover's carries its fence)."""
    waits = 0
    current: Outcome[Any] | None = judged
    while current is not None and current.status is Status.IN_PROGRESS:
        left_s = (deadline_ms - policy.clock()) / 1000
        if left_s <= 0:
            break
        waits += 1
        yield Pause(min(_HOLDER_BACKOFF.delay_s(waits), left_s))
        request = dataclasses.replace(request, now_ms=policy.clock())
        try:
            claim = yield Claim(request)
        except StoreConflictError:
            continue  # the holder's record is busy (see message_flow): still in progress
        current = judge(policy, request, claim)
    return current, request, claim


# Short at first (most handlers finish in milliseconds), at most half a second between claims.
_HOLDER_BACKOFF = Backoff(0.01, 0.5)


class ConflictRetries:
    """When a transaction that hit a deadlock runs again; the shells only call and catch::

        retries = ConflictRetries(owns_transaction=connection is None)
        while True:
            try:
                with store.transaction(connection) as tx:
                    return drive(flow, execute_in(tx))
            except StoreConflictError as exc:
                if not retries.again(exc):
                    raise

    A deadlock (or serialization failure, or lock timeout) means the server rolled the whole
    transaction back: nothing of it is left, so idemq runs it again, up to
    :data:`~idemq.guard.core.CLAIM_ATTEMPTS` times — but only a transaction idemq opened.
    Inside the caller's transaction the caller's earlier work is gone too, and only the caller
    can redo it: the error goes to the caller.
    """

    __slots__ = ("_conflicts", "owns_transaction")

    def __init__(self, *, owns_transaction: bool) -> None:
        self.owns_transaction = owns_transaction
        self._conflicts = 0

    def again(self, exc: Exception) -> bool:
        """Whether the transaction that raised ``exc`` runs again (False: let ``exc`` go on)."""
        if isinstance(exc, StoreConflictError) and self.owns_transaction:
            self._conflicts += 1
            return self._conflicts < CLAIM_ATTEMPTS
        return False
