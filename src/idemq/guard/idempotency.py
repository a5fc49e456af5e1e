"""``Idempotency``: the guard's sync shell over :mod:`idemq.guard.core`.

It only sequences store calls; what a claim means is decided in :func:`idemq.guard.core.judge`,
what a batch does next in :mod:`idemq.guard.batch_flow`. :mod:`idemq.guard.idempotency_async` is
its asyncio twin, built on the same base (:class:`GuardBase`) and the same I/O-free decisions.

Transactional mode (SQL)::

    BEGIN
      claim_in   — INSERT the dedup row as PROCESSED; a concurrent twin blocks on the row lock
      judge      — existing row? → DUPLICATE (result replayed) / IN_PROGRESS, nothing else written
      handler(tx)— the business writes, through the same connection
      save_result_in (only when the result is not None: one statement saved on the common path)
    COMMIT       — dedup row and effect become visible together, or neither does

Lease mode (any store)::

    claim        — PROCESSING with owner token and lease expiry (or take over an expired lease)
    handler(None)
    complete     — PROCESSED with result, refused if the lease was taken over (LeaseLostError)
    release      — on handler error, so the message can be retried at once
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, TypeVar, cast

from idemq.errors import StoreConflictError
from idemq.guard.base import GuardBase, call_with_tx, key_of, optional_call
from idemq.guard.batch_flow import (
    BatchPasses,
    BatchPlan,
    Flow,
    Handle,
    HandlerFailedError,
    batch_flow,
    plan_batch,
)
from idemq.guard.codec import NULL_RESULT, encode_result
from idemq.guard.core import CLAIM_ATTEMPTS, Mode, Outcome, judge, processed
from idemq.guard.probes import Probe, claim_status, report_batch, watch_handler
from idemq.message import Message
from idemq.stores.base import (
    Claim,
    ClaimRequest,
    Store,
    TransactionalStore,
)

__all__ = ["Idempotency"]

T = TypeVar("T")


class Idempotency(GuardBase[Store]):
    """Guards message handlers so each message's effect happens once.

    ``Idempotency(SqlStore(url), consumer="orders")`` runs handlers in the dedup transaction;
    ``mode="lease", lease_s=30`` (the only mode of ``RedisStore``) claims with an expiring lease.
    ``clock`` returns epoch milliseconds (inject a fake one to test lease expiry).
    """

    _transactional_protocol = TransactionalStore

    def process(
        self,
        message_id: str,
        handler: Callable[[Any], T],
        *,
        business_id: str | None = None,
        payload: object = None,
        connection: Any = None,
    ) -> Outcome[T]:
        """Run ``handler(tx)`` unless ``message_id`` was processed before; see the module doc.

        ``connection``: an SQLAlchemy ``Connection`` or ORM ``Session`` of yours; the dedup row
        joins its open transaction (in a savepoint) and you commit it. Handler exceptions roll back
        (or release the lease) and are re-raised, so the message can be retried.
        """
        observer = self.observer
        if observer is None:
            return self._process(message_id, handler, business_id, payload, connection)
        probe = observer.begin(self.policy.consumer, str(message_id))
        try:
            outcome = self._process(
                message_id, watch_handler(probe, handler), business_id, payload, connection, probe
            )
        except BaseException as exc:
            probe.finished(None, exc)
            raise
        probe.finished(outcome, None)
        return outcome

    def _process(  # noqa: PLR0917 - private, called from process() only
        self,
        message_id: str,
        handler: Callable[[Any], T],
        business_id: str | None,
        payload: object,
        connection: Any,
        probe: Probe | None = None,
    ) -> Outcome[T]:
        request = self.policy.request(message_id, business_id, payload)
        if self.policy.mode is Mode.LEASE:
            return self._process_lease(request, handler, probe)
        if connection is not None:
            return self._process_in(request, handler, connection, probe)
        for attempt in range(1, CLAIM_ATTEMPTS + 1):
            try:
                return self._process_in(request, handler, None, probe)
            except StoreConflictError:
                # Deadlock while claiming (MariaDB: two twins waiting on a rolled-back insert).
                # The transaction rolled back before the handler ran, so a retry is clean.
                if attempt == CLAIM_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _process_in(
        self,
        request: ClaimRequest,
        handler: Callable[[Any], T],
        connection: Any,
        probe: Probe | None,
    ) -> Outcome[T]:
        store = cast(TransactionalStore, self.store)
        with store.transaction(connection) as tx:
            claim = store.claim_in(tx, request)
            if probe is not None:
                probe.claimed(claim_status(claim))
            outcome = judge(request, claim)
            if outcome is not None:
                return outcome
            result = handler(tx)
            encoded = encode_result(result)
            if encoded != NULL_RESULT:
                store.save_result_in(tx, request.key, encoded)
        return processed(request, result)

    def _process_lease(
        self, request: ClaimRequest, handler: Callable[[Any], T], probe: Probe | None
    ) -> Outcome[T]:
        store = self.store
        claim = store.claim(request)
        if probe is not None:
            probe.claimed(claim_status(claim))
        outcome = judge(request, claim)
        if outcome is not None:
            return outcome
        try:
            result = handler(None)
            encoded = encode_result(result)
        except BaseException as exc:
            self._release(request, exc)
            raise
        store.complete(request.key, request.owner, encoded, self.policy.clock())
        return processed(request, result)

    def _release(self, request: ClaimRequest, cause: BaseException) -> None:
        try:
            self.store.release(request.key, request.owner)
        except Exception as exc:
            # The lease still expires on its own; the handler's error is the one to surface.
            cause.add_note(f"idemq: releasing the claim failed too ({exc!r}); it will expire")

    def process_batch(
        self,
        messages: Sequence[Message],
        handler: Callable[[Message, Any], Any],
        *,
        connection: Any = None,
    ) -> list[Outcome[Any]]:
        """Guard a batch with one claim round trip; ``handler(msg, tx)`` runs for each new one.

        Outcomes come back in message order. In transactional mode every handler runs in one
        transaction, each in its own savepoint: a message whose handler raises gets a FAILED
        outcome (its claim is undone, so it can be retried) and does not roll back the others.
        Savepoints cost two statements per message, so the batch first runs without them; only
        if a handler raises is that transaction rolled back whole and the batch run again with
        a savepoint per message (handlers of the good messages then run twice; their writes
        commit once). A deadlock reruns the batch when idemq owns the transaction.
        """
        outcomes = self._process_batch(messages, handler, connection)
        if self.observer is not None:
            report_batch(self.observer, self.policy.consumer, outcomes)
        return outcomes

    def _process_batch(
        self, messages: Sequence[Message], handler: Callable[[Message, Any], Any], connection: Any
    ) -> list[Outcome[Any]]:
        plan = plan_batch(self.policy, messages)
        by_request = [messages[i] for i in plan.first_index]
        if self.policy.mode is Mode.LEASE:
            flow = batch_flow(plan, by_request, isolated=True)
            return plan.assemble(
                _drive(flow, self.store.claim_many, lambda step: self._handle_leased(handler, step))
            )
        passes = BatchPasses(owns_transaction=connection is None)
        while True:
            try:
                return plan.assemble(self._batch_in(plan, by_request, handler, connection, passes))
            except (HandlerFailedError, StoreConflictError) as exc:
                if not passes.again(exc):
                    raise

    def _batch_in(
        self,
        plan: BatchPlan,
        by_request: list[Message],
        handler: Callable[[Message, Any], Any],
        connection: Any,
        passes: BatchPasses,
    ) -> list[Outcome[Any]]:
        """One pass of a transactional batch, in one transaction."""
        store = cast(TransactionalStore, self.store)
        flow = batch_flow(plan, by_request, isolated=passes.isolated, failures=passes.failures)
        with store.transaction(connection) as tx:
            return _drive(
                flow,
                lambda requests: store.claim_many_in(tx, requests),
                lambda step: self._handle_in(tx, handler, step),
            )

    def _handle_in(
        self, tx: Any, handler: Callable[[Message, Any], Any], step: Handle
    ) -> tuple[bool, Any]:
        """A :class:`Handle` step in the batch's transaction (isolated: in a savepoint)."""
        store = cast(TransactionalStore, self.store)
        request = step.request
        try:
            with store.savepoint(tx) if step.isolated else nullcontext():
                result = _handle_and_save(store, tx, request, handler(step.message, tx))
        except Exception as exc:
            # Its writes are rolled back; its claim goes too, so it can be retried.
            if step.isolated:
                store.release_in(tx, request.key, request.owner)
            return False, exc
        return True, result

    def _handle_leased(
        self, handler: Callable[[Message, Any], Any], step: Handle
    ) -> tuple[bool, Any]:
        """A :class:`Handle` step in lease mode: complete the claim, or release it."""
        request = step.request
        try:
            result = handler(step.message, None)
            encoded = encode_result(result)
        except Exception as exc:
            self._release(request, exc)
            return False, exc
        self.store.complete(request.key, request.owner, encoded, self.policy.clock())
        return True, result

    def idempotent(
        self,
        key: Callable[..., object],
        *,
        business_id: Callable[..., object] | None = None,
        payload: Callable[..., object] | None = None,
    ) -> Callable[[Callable[..., T]], Callable[..., Outcome[T]]]:
        """Decorator sugar over :meth:`process`: ``key(*args, **kwargs)`` gives the message id.

        The decorated function gets the transaction as a ``tx`` keyword if it declares one, and
        returns the :class:`Outcome` (``.result`` is the function's return value, replayed for
        duplicates), so an IN_PROGRESS duplicate can never pass for a success.
        """

        def decorate(fn: Callable[..., T]) -> Callable[..., Outcome[T]]:
            bind = call_with_tx(fn)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Outcome[T]:
                return self.process(
                    cast(str, key_of(key, args, kwargs)),
                    bind(*args, **kwargs),
                    business_id=optional_call(business_id, args, kwargs),
                    payload=optional_call(payload, args, kwargs),
                )

            return wrapper

        return decorate


def _handle_and_save(
    store: TransactionalStore, tx: Any, request: ClaimRequest, result: object
) -> object:
    encoded = encode_result(result)
    if encoded != NULL_RESULT:
        store.save_result_in(tx, request.key, encoded)
    return result


def _drive(
    flow: Flow,
    claim: Callable[[list[ClaimRequest]], list[Claim]],
    handle: Callable[[Handle], tuple[bool, Any]],
) -> list[Outcome[Any]]:
    """Carry out the steps of a :func:`~idemq.guard.batch_flow.batch_flow`; returns its outcomes."""
    reply: Any = None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            return cast(list[Outcome[Any]], stop.value)
        reply = claim(step) if isinstance(step, list) else handle(step)
