"""The decision logic of ``process_batch``, with no I/O: the sync and async guards only drive it.

A batch is reduced to one claim per distinct valid key (:func:`plan_batch`), claimed in one round
trip, judged claim by claim, and each new message handled on its own. :func:`batch_flow` says what
to do next as *steps* — claim these requests, handle this message — and the shells in
:mod:`idemq.guard.idempotency` carry each step out with or without ``await``::

    flow = batch_flow(plan, messages, isolated=…)
    step = next(flow)                     # list[ClaimRequest]: claim them, send the claims
    step = flow.send(claims)              # Handle: run the handler, send (ok, result-or-error)
    …                                     # StopIteration.value: one outcome per request

In a transaction the batch first runs *optimistic*: no savepoints (two statements per message),
so one raising handler fails the whole pass and :class:`BatchPasses` reruns it *isolated* — each
message in its own savepoint, the one that raised marked FAILED without running it again. In lease
mode every message is isolated anyway: its claim is its own record.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from idemq.errors import InvalidInputError, PayloadMismatchError, StoreConflictError
from idemq.guard.core import CLAIM_ATTEMPTS, Outcome, Policy, Status, judge, processed
from idemq.stores.base import Claim, ClaimRequest

__all__ = [
    "BatchItem",
    "BatchPasses",
    "BatchPlan",
    "Flow",
    "Handle",
    "HandlerFailedError",
    "batch_flow",
    "failed",
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
            slots.append(Outcome(Status.FAILED, str(msg.id), error=exc))
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
            slots.append(Outcome(Status.FAILED, message_id, error=error))
            continue
        slots.append(seen[message_id])
    return BatchPlan(requests, first_index, slots)


def failed(request: ClaimRequest, error: BaseException) -> Outcome[Any]:
    """The outcome of one batch message whose handler (or payload check) raised."""
    return Outcome(Status.FAILED, request.key.message_id, error=error)


@dataclass(frozen=True, slots=True)
class Handle:
    """Step: run the handler of ``message`` and keep its result (saved in the transaction, or
    the lease completed). ``isolated``: on its own — in a transaction, inside a savepoint, its
    claim released if the handler raises. The shell sends back ``(True, result)``, or
    ``(False, error)`` when the handler raised — after undoing what it can (savepoint rolled back
    and claim released, or lease released). A failing store raises instead: that fails the
    batch, not the message."""

    request: ClaimRequest
    message: Any
    isolated: bool


Step = list[ClaimRequest] | Handle
Flow = Generator[Step, Any, list[Outcome[Any]]]


def batch_flow(
    plan: BatchPlan,
    messages: Sequence[Any],
    *,
    isolated: bool,
    failures: dict[int, Exception] | None = None,
) -> Flow:
    """One pass over the requests of ``plan``; returns an outcome per request, in their order.

    ``messages[i]`` is the message of ``plan.requests[i]``. ``failures``: requests whose handler
    already raised in an earlier pass — FAILED as they are, neither claimed nor run. Not
    ``isolated``: the first raising handler ends the pass with :class:`HandlerFailedError`.
    """
    failures = failures or {}
    to_claim = [r for i, r in enumerate(plan.requests) if i not in failures]
    claims: list[Claim] = (yield to_claim) if to_claim else []
    claimed = iter(claims)
    outcomes: list[Outcome[Any]] = []
    for i, request in enumerate(plan.requests):
        if i in failures:
            outcomes.append(failed(request, failures[i]))
            continue
        try:
            judged = judge(request, next(claimed))
        except Exception as exc:  # a payload mismatch fails only this message
            outcomes.append(failed(request, exc))
            continue
        if judged is not None:
            outcomes.append(judged)
            continue
        ok, value = yield Handle(request, messages[i], isolated)
        if ok:
            outcomes.append(processed(request, value))
        elif isolated:
            outcomes.append(failed(request, value))
        else:
            raise HandlerFailedError(i, value) from value
    return outcomes


class HandlerFailedError(Exception):
    """A handler raised in an optimistic (savepoint-free) pass: rerun the batch isolated."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index  # in BatchPlan.requests
        self.error = error


class BatchPasses:
    """When a transactional batch runs again, and how; the shells only call and catch::

        passes = BatchPasses(owns_transaction=connection is None)
        while True:
            try:
                return run_pass(passes.isolated, passes.failures)
            except (HandlerFailedError, StoreConflictError) as exc:
                if not passes.again(exc):
                    raise

    A handler that raised in the optimistic pass makes the next pass isolated (the whole
    transaction rolled back, so the others' writes are redone, once). A deadlock rolled the
    whole pass back: it runs again, up to :data:`CLAIM_ATTEMPTS` times, when idemq owns the
    transaction — inside the caller's, the caller has to retry.
    """

    __slots__ = ("_conflicts", "_owns_transaction", "failures")

    def __init__(self, *, owns_transaction: bool) -> None:
        self._owns_transaction = owns_transaction
        self._conflicts = 0
        self.failures: dict[int, Exception] | None = None

    @property
    def isolated(self) -> bool:
        return self.failures is not None

    def again(self, exc: Exception) -> bool:
        """Whether the pass that raised ``exc`` runs again (``False``: let ``exc`` propagate)."""
        if isinstance(exc, HandlerFailedError) and self.failures is None:
            self.failures = {exc.index: exc.error}
            self._conflicts = 0
            return True
        if isinstance(exc, StoreConflictError) and self._owns_transaction:
            self._conflicts += 1
            return self._conflicts < CLAIM_ATTEMPTS
        return False
