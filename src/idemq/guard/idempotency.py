"""``Idempotency``: the guard's sync shell.

It carries out the steps of :mod:`idemq.guard.flow` (one message) and
:mod:`idemq.guard.batch_flow` (a batch) against a sync store, inside a transaction of the store
when the guard is transactional; every decision is taken in those flows, once for this shell and
its asyncio twin, :class:`~idemq.guard.idempotency_async.AsyncIdempotency`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from idemq._plan import drive
from idemq.errors import StoreConflictError
from idemq.guard import context
from idemq.guard.base import GuardBase, bind_handler
from idemq.guard.batch_flow import BatchPasses, HandlerFailedError
from idemq.guard.core import Outcome
from idemq.guard.flow import ConflictRetries, Flow, RunHandler, Step, StoreStep, message_flow
from idemq.guard.renewal import Holding, LeaseKeeper
from idemq.message import Message
from idemq.stores.base import ForgetResult, GuardStore, TransactionalGuardStore

__all__ = ["Idempotency"]

T = TypeVar("T")


class Idempotency(GuardBase[GuardStore]):
    """Guards message handlers so each message's effect happens once.

    ``Idempotency(SqlStore(url), consumer="orders")`` runs handlers in the dedup transaction;
    ``mode="lease", lease_s=30`` (the only mode of ``RedisStore``) claims with an expiring lease.
    ``clock`` returns epoch milliseconds (inject a fake one to test lease expiry).
    """

    _transactional_protocol = TransactionalGuardStore
    _keeper: LeaseKeeper | None = None

    def process(
        self,
        message_id: str,
        handler: Callable[[Any], T],
        *,
        business_id: str | None = None,
        payload: object = None,
        connection: Any = None,
    ) -> Outcome[T]:
        """Run ``handler(tx)`` unless ``message_id`` was processed before.

        ``tx`` is the connection of the dedup transaction (transactional mode) or ``None``
        (lease mode). ``connection``: an SQLAlchemy ``Connection`` or ORM ``Session`` of yours;
        the dedup row joins its open transaction (in a savepoint) and you commit it. Handler
        exceptions roll back (or release the lease) and are re-raised, so the message can be
        retried. See :mod:`idemq.guard.flow` for the steps.
        """
        with self._observed(message_id) as observed:
            request = self.policy.request(message_id, business_id, payload)
            observed.outcome = self._run(
                lambda _retries: message_flow(self.policy, request, observed.probe, self.cache),
                bind_handler(handler),
                connection,
                ConflictRetries,
            )
        self._remember(request, observed.outcome, committed=connection is None)
        return cast(Outcome[T], observed.outcome)

    def process_batch(
        self,
        messages: Sequence[Message],
        handler: Callable[[Message, Any], Any],
        *,
        connection: Any = None,
    ) -> list[Outcome[Any]]:
        """Guard a batch with one claim round trip; ``handler(msg, tx)`` runs for each new one.

        Outcomes come back in message order. In transactional mode every handler runs in one
        transaction: a message whose handler raises gets a FAILED outcome (its claim is undone,
        so it can be retried) and does not roll back the others. See
        :mod:`idemq.guard.batch_flow` for how (an optimistic pass, then an isolated one).
        """
        plan, make_flow = self._batch(messages)
        outcomes = self._run(make_flow, handler, connection, BatchPasses, holds=True)
        for request, outcome in zip(plan.requests, outcomes, strict=True):
            self._remember(request, outcome, committed=connection is None)
        return self._report_batch(plan.assemble(outcomes))

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
            call_for = self._call_for(fn, key=key, business_id=business_id, payload=payload)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Outcome[T]:
                message_id, handler, options = call_for(args, kwargs)
                return self.process(message_id, handler, **options)

            return wrapper

        return decorate

    def forget(self, message_id: str, *, force: bool = False) -> ForgetResult:
        """Forget that ``message_id`` was processed (or claimed): its next delivery runs again.

        For a message whose effect was undone by hand, or a stuck claim an operator has checked.
        A live lease is refused (:attr:`~idemq.stores.base.ForgetResult.LIVE_LEASE`) unless
        ``force``: its holder may be in the middle of the effect.
        """
        if self.cache is not None:
            self.cache.forget(message_id)
        return self.store.forget(
            message_id, self.policy.consumer, force=force, now_ms=self.policy.clock()
        )

    # -- carrying the steps out ------------------------------------------------------------

    @property
    def _lease_keeper(self) -> LeaseKeeper:
        if self._keeper is None:
            self._keeper = LeaseKeeper(self.store.renew, self.policy.clock)
        return self._keeper

    def _run(
        self,
        make_flow: Callable[[Any], Flow],
        handler: Callable[[Any, Any], Any],
        connection: Any,
        retries_type: type[ConflictRetries],
        *,
        holds: bool = False,
    ) -> Any:
        """Drive a flow: as it is in lease mode; in transactional mode inside a transaction,
        made again from ``make_flow(retries)`` each time ``retries`` says the transaction runs
        again (a deadlock, or a batch's handler failure before its isolated pass).

        ``holds``: the flow is a lease-mode batch's, which holds the claims of its later
        messages while an earlier handler runs; a single message holds none to renew."""
        retries = retries_type(owns_transaction=connection is None)
        if not self._transactional:
            if not holds:
                return drive(make_flow(retries), functools.partial(self._execute, None, handler))
            with self._lease_keeper.holding() as holding:
                execute = functools.partial(self._execute, None, handler, holding=holding)
                return drive(make_flow(retries), execute)
        store = cast(TransactionalGuardStore, self.store)
        while True:
            try:
                with store.transaction(connection) as tx:
                    flow = make_flow(retries)
                    return drive(flow, functools.partial(self._execute, tx, handler))
            except (StoreConflictError, HandlerFailedError) as exc:
                if not retries.again(exc):
                    raise

    def _execute(
        self,
        tx: Any,
        handler: Callable[[Any, Any], Any],
        step: Step,
        *,
        holding: Holding | None = None,
    ) -> Any:
        """Carry out one step: a store primitive (most steps are), or the handler (its outcome
        as data), or a pause."""
        if isinstance(step, StoreStep):
            return step.call(self.store, tx)
        if isinstance(step, RunHandler):
            token = context.enter(step.context)
            kept = None
            try:
                # A batch holds the claims of its later messages (step.held) until their turn;
                # the claim of this one is renewed while its handler runs (if it has a lease).
                if holding is not None:
                    holding.keep(step.held)
                if step.lease is not None:
                    kept = self._lease_keeper.keep(step.lease, step.context)
                return True, handler(step.message, tx)
            except BaseException as exc:  # the flow decides; it re-raises what must go on
                return False, exc
            finally:
                if kept is not None:
                    self._lease_keeper.stop(kept)
                context.leave(token)
        time.sleep(step.seconds)
        return None
