"""``process_batch`` as steps, with no I/O: the sync and async guards only carry them out.

A batch is reduced to one claim per distinct valid key (:func:`plan_batch`), claimed in one round
trip, judged claim by claim, and each new message handled on its own, with the step vocabulary of
a single message (:mod:`idemq.guard.flow`)::

    ClaimManyIn / ClaimMany          every request of the pass, one round trip
    per new message:
      [OpenSavepoint]                 isolated pass only
      RunHandler                      handler(msg, tx)
      ConfirmIn | Complete            the result (a row updated, a lease completed); in a
                                      transaction, a lost one (the handler caught a database
                                      error) is this message's failure
      [CloseSavepoint, ReleaseIn]     isolated pass only: its writes, then its claim, undone on
                                      failure — the message is FAILED, the others go on
      Release                         lease mode, on failure
    ConfirmManyIn                     transactional: every PROCESSED message's row still held

In a transaction the batch first runs *optimistic*: no savepoints (two statements per message),
so one raising handler fails the whole pass and :class:`BatchPasses` reruns it *isolated* — each
message in its own savepoint, the one that raised marked FAILED without running it again. A store
error in any step fails the whole pass, never one message: after it the transaction may be gone
(a deadlock rolls it back whole), and carrying on would report PROCESSED for effects that never
committed. In lease mode every message is isolated anyway: its claim is its own record.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from idemq.errors import (
    InvalidInputError,
    LeaseLostError,
    PayloadMismatchError,
    StoreError,
    TransactionLostError,
)
from idemq.guard.core import Mode, Outcome, Policy, Status, judge
from idemq.guard.flow import (
    ClaimMany,
    ClaimManyIn,
    CloseSavepoint,
    Complete,
    ConfirmIn,
    ConfirmManyIn,
    ConflictRetries,
    HandlerRun,
    OpenSavepoint,
    ReleaseIn,
    Step,
    raise_if_transaction_lost,
    release_noting_failure,
    run_handler,
)
from idemq.stores.base import Claim, ClaimRequest

__all__ = [
    "BatchFlow",
    "BatchItem",
    "BatchPasses",
    "BatchPlan",
    "HandlerFailedError",
    "batch_flow",
    "plan_batch",
]


class BatchItem(Protocol):
    """What ``process_batch`` needs of a message (``idemq.Message`` has it)."""

    @property
    def id(self) -> str: ...

    @property
    def body(self) -> bytes: ...

    @property
    def business_id(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A batch reduced to one claim per distinct valid key.

    ``slots[i]`` is either the index in ``requests`` that message ``i`` maps to (a repeated id maps
    to its first occurrence, so it is handled once), or its final outcome when it was invalid.
    """

    requests: list[ClaimRequest]
    first_index: list[int]  # message index of each request's first occurrence
    slots: list[int | Outcome[Any]]

    def assemble(self, per_request: list[Outcome[Any]]) -> list[Outcome[Any]]:
        """Outcomes in message order; a repeat of an id shares its first occurrence's fate."""
        out: list[Outcome[Any]] = []
        for i, slot in enumerate(self.slots):
            if isinstance(slot, Outcome):
                out.append(slot)
                continue
            first = per_request[slot]
            if i != self.first_index[slot] and first.status is Status.PROCESSED:
                first = Outcome(Status.DUPLICATE, first.message_id, first.result, first.record)
            out.append(first)
        return out


def plan_batch(policy: Policy, messages: Sequence[BatchItem]) -> BatchPlan:
    """Validate every message; an invalid one becomes a FAILED outcome, not a failed batch."""
    requests: list[ClaimRequest] = []
    first_index: list[int] = []
    slots: list[int | Outcome[Any]] = []
    seen: dict[str, int] = {}
    for i, msg in enumerate(messages):
        try:
            request = policy.request(msg.id, msg.business_id, msg.body)
        except InvalidInputError as exc:
            slots.append(Outcome.failed(str(msg.id), exc))
            continue
        message_id = request.key.message_id
        if message_id not in seen:
            seen[message_id] = len(requests)
            requests.append(request)
            first_index.append(i)
        first = requests[seen[message_id]]
        if (
            request.payload_hash is not None
            and first.payload_hash is not None
            and request.payload_hash != first.payload_hash
        ):
            # The same id twice in one batch with different bodies: the repeat is not a
            # duplicate of the first, it is a producer bug — as it would be across batches.
            error = PayloadMismatchError(message_id, first.payload_hash, request.payload_hash)
            slots.append(Outcome.failed(message_id, error))
            continue
        slots.append(seen[message_id])
    return BatchPlan(requests, first_index, slots)


BatchFlow = Generator[Step, Any, list[Outcome[Any]]]


def batch_flow(
    policy: Policy,
    plan: BatchPlan,
    messages: Sequence[Any],
    *,
    isolated: bool,
    failures: dict[int, Exception] | None = None,
) -> BatchFlow:
    """One pass over the requests of ``plan``; returns an outcome per request, in their order.

    ``messages[i]`` is the message of ``plan.requests[i]``. ``failures``: requests whose handler
    already raised in an earlier pass — FAILED as they are, neither claimed nor run. A
    transactional pass that is not ``isolated`` ends at the first raising handler, with
    :class:`HandlerFailedError`.
    """
    transactional = policy.mode is Mode.TRANSACTIONAL
    # A lease-mode message is isolated whatever the pass: its claim is its own record.
    isolated = isolated or not transactional
    failures = failures or {}
    to_claim = [r for i, r in enumerate(plan.requests) if i not in failures]
    claims: list[Claim] = []
    if to_claim:
        claims = yield ClaimManyIn(to_claim) if transactional else ClaimMany(to_claim)
    claimed = iter(claims)
    outcomes: list[Outcome[Any]] = []
    processed: list[ClaimRequest] = []
    for i, request in enumerate(plan.requests):
        message_id = request.key.message_id
        if i in failures:
            outcomes.append(Outcome.failed(message_id, failures[i]))
            continue
        claim = next(claimed)
        try:
            judged = judge(policy, request, claim)
        except PayloadMismatchError as exc:  # fails only this message
            outcomes.append(Outcome.failed(message_id, exc))
            continue
        if judged is not None:
            outcomes.append(judged)
            continue
        if transactional:
            run = yield from _handle_in_transaction(policy, request, messages[i], isolated)
        else:
            run = yield from _handle_leased(policy, request, messages[i], claim.fence)
        if run.error is None:
            outcomes.append(Outcome.processed(message_id, run.result))
            processed.append(request)
        elif not isinstance(run.error, Exception):
            raise run.error  # KeyboardInterrupt, cancellation: the batch stops here
        elif isolated:
            outcomes.append(Outcome.failed(message_id, run.error))
        else:
            raise HandlerFailedError(i, run.error) from run.error
    if transactional and processed:
        # A later handler that caught a deadlock may have lost the whole transaction, earlier
        # messages' rows with it: the pass is PROCESSED only if every row is still held.
        yield ConfirmManyIn(processed)
    return outcomes


def _handle_in_transaction(
    policy: Policy, request: ClaimRequest, message: Any, isolated: bool
) -> Generator[Step, Any, HandlerRun]:
    savepoint = (yield OpenSavepoint()) if isolated else None
    run = yield from run_handler(policy, request, message, None)
    if run.error is not None:
        yield from raise_if_transaction_lost(run.error)  # fails the pass, never one message
    else:
        try:
            yield ConfirmIn(request.key, request.owner, run.encoded, deferred=True)
        except TransactionLostError as exc:
            # This handler caught a database error and lost the transaction (PostgreSQL
            # aborted it): its failure, as if it had raised. Optimistic pass: the isolated one
            # marks it FAILED; isolated: its savepoint's rollback restores the transaction.
            run = HandlerRun(error=exc)
    if isolated:
        try:
            yield CloseSavepoint(savepoint, commit=run.error is None)
        except StoreError as exc:
            if isinstance(run.error, TransactionLostError):
                # The savepoint went with the transaction (InnoDB rolled it back whole): the
                # pass fails and, as a conflict, runs again.
                raise run.error from exc
            raise
        if run.error is not None:
            # Its dedup row was written with the batch's claims: undo it too, so that the
            # message can be retried rather than answered DUPLICATE with no effect.
            yield ReleaseIn(request.key, request.owner)
    return run


def _handle_leased(
    policy: Policy, request: ClaimRequest, message: Any, fence: int | None
) -> Generator[Step, Any, HandlerRun]:
    run = yield from run_handler(policy, request, message, None, fence)
    if run.error is not None:
        yield from release_noting_failure(request, run.error)
        return run
    try:
        yield Complete(request.key, request.owner, run.encoded, policy.clock())
    except LeaseLostError as exc:
        # Another worker took this message over while its handler ran: it is that worker's
        # now. The rest of the batch stands; this delivery is retried and meets its record.
        return HandlerRun(error=exc)
    return run


class HandlerFailedError(Exception):
    """A handler raised in an optimistic (savepoint-free) pass: rerun the batch isolated."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index  # in BatchPlan.requests
        self.error = error


class BatchPasses(ConflictRetries):
    """When a transactional batch runs again, and how (see :class:`ConflictRetries` for the
    shells' loop, which catches :class:`HandlerFailedError` too).

    A handler that raised in the optimistic pass makes the next pass isolated (the whole
    transaction rolled back, so the others' writes are redone, once). A deadlock rolled the
    whole pass back: it runs again as a conflict, when idemq owns the transaction.
    """

    __slots__ = ("failures",)

    def __init__(self, *, owns_transaction: bool) -> None:
        super().__init__(owns_transaction=owns_transaction)
        self.failures: dict[int, Exception] | None = None

    @property
    def isolated(self) -> bool:
        """Whether the next pass runs each message in its own savepoint."""
        return self.failures is not None

    def again(self, exc: Exception) -> bool:
        """Whether the pass that raised ``exc`` runs again (``False``: let ``exc`` propagate)."""
        if isinstance(exc, HandlerFailedError) and self.failures is None:
            self.failures = {exc.index: exc.error}
            self._conflicts = 0
            return True
        return super().again(exc)
