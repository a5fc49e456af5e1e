"""``AsyncIdempotency``: the guard's asyncio shell.

The same flows as :class:`~idemq.guard.idempotency.Idempotency` (:mod:`idemq.guard.flow`,
:mod:`idemq.guard.batch_flow`), the same arguments and decisions; only the store calls and the
handler are awaited. Handlers may be coroutine functions or plain functions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from idemq._plan import adrive
from idemq.errors import LeaseLostError, StoreConflictError
from idemq.guard import context
from idemq.guard.base import GuardBase, Observed, bind_handler
from idemq.guard.batch_flow import BatchPasses, HandlerFailedError
from idemq.guard.core import Mode, Outcome
from idemq.guard.flow import ConflictRetries, Flow, RunHandler, Step, StoreStep, message_flow
from idemq.guard.inflight import InFlight
from idemq.guard.renewal import AsyncHolding, AsyncKeeping
from idemq.message import Message
from idemq.stores.base import (
    AsyncGuardStore,
    AsyncTransactionalGuardStore,
    ClaimRequest,
    ForgetResult,
)

__all__ = ["AsyncIdempotency"]

T = TypeVar("T")


class AsyncIdempotency(GuardBase[AsyncGuardStore]):
    """The asyncio twin of :class:`~idemq.Idempotency`: same arguments, ``await guard.process()``.

    ``handler`` may be a coroutine function or a plain function.
    """

    _transactional_protocol = AsyncTransactionalGuardStore

    @functools.cached_property
    def _inflight(self) -> InFlight | None:
        """The calls in flight, when duplicates wait for them (lease mode with ``wait_s``)."""
        policy = self.policy
        return InFlight(policy) if policy.mode is Mode.LEASE and policy.wait_ms > 0 else None

    async def process(
        self,
        message_id: str,
        handler: Callable[[Any], Awaitable[T] | T],
        *,
        business_id: str | None = None,
        payload: object = None,
        connection: Any = None,
    ) -> Outcome[T]:
        """See :meth:`Idempotency.process` (``connection``: an ``AsyncConnection``).

        In lease mode with ``wait_s``, a call whose message id this guard is already running
        waits for that call (:mod:`idemq.guard.inflight`) rather than polling the store.
        """
        with self._observed(message_id) as observed:
            request = self.policy.request(message_id, business_id, payload)
            bound = bind_handler(handler)
            if self._inflight is None:
                observed.outcome = await self._process_one(request, bound, connection, observed)
            else:
                observed.outcome = await self._process_waiting(request, bound, observed)
        self._remember(request, observed.outcome, committed=connection is None)
        return cast(Outcome[T], observed.outcome)

    async def _process_one(
        self,
        request: ClaimRequest,
        handler: Callable[[Any, Any], Any],
        connection: Any,
        observed: Observed,
        wait_until_ms: int | None = None,
    ) -> Outcome[Any]:
        """One message through the store."""
        return cast(
            Outcome[Any],
            await self._run(
                lambda _retries: message_flow(
                    self.policy, request, observed.probe, self.cache, wait_until_ms
                ),
                handler,
                connection,
                ConflictRetries,
            ),
        )

    async def _process_waiting(
        self, request: ClaimRequest, handler: Callable[[Any, Any], Any], observed: Observed
    ) -> Outcome[Any]:
        """Lease mode with ``wait_s``: the first call of a message id goes to the store, the
        calls of that id arriving while it runs wait for it; a waiter it leaves without a
        result (it raised, or its own wait ran out) asks the store for the rest of its wait."""
        inflight = cast(InFlight, self._inflight)
        running = inflight.holder(request)
        if running is None:
            outcome: Outcome[Any] | None = None
            try:
                outcome = await self._process_one(request, handler, None, observed)
            finally:
                inflight.finish(request, outcome)
            return outcome
        answered = await inflight.wait(running, request)
        if answered is not None:
            return answered
        until_ms = request.now_ms + self.policy.wait_ms
        again = dataclasses.replace(request, now_ms=self.policy.clock())
        return await self._process_one(again, handler, None, observed, until_ms)

    async def process_batch(
        self,
        messages: Sequence[Message],
        handler: Callable[[Message, Any], Any],
        *,
        connection: Any = None,
    ) -> list[Outcome[Any]]:
        """See :meth:`Idempotency.process_batch`; ``handler`` may be async."""
        plan, make_flow = self._batch(messages)
        outcomes = await self._run(make_flow, handler, connection, BatchPasses, holds=True)
        for request, outcome in zip(plan.requests, outcomes, strict=True):
            self._remember(request, outcome, committed=connection is None)
        return self._report_batch(plan.assemble(outcomes))

    def idempotent(
        self,
        key: Callable[..., object],
        *,
        business_id: Callable[..., object] | None = None,
        payload: Callable[..., object] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[Outcome[Any]]]]:
        """See :meth:`Idempotency.idempotent`; the decorated function may be async."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[Outcome[Any]]]:
            call_for = self._call_for(fn, key=key, business_id=business_id, payload=payload)

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Outcome[Any]:
                message_id, handler, options = call_for(args, kwargs)
                return await self.process(message_id, handler, **options)

            return wrapper

        return decorate

    async def forget(self, message_id: str, *, force: bool = False) -> ForgetResult:
        """Forget that ``message_id`` was processed (or claimed): its next delivery runs again.

        For a message whose effect was undone by hand, or a stuck claim an operator has checked.
        A live lease is refused (:attr:`~idemq.stores.base.ForgetResult.LIVE_LEASE`) unless
        ``force``: its holder may be in the middle of the effect.
        """
        if self.cache is not None:
            self.cache.forget(message_id)
        return await self.store.forget(
            message_id, self.policy.consumer, force=force, now_ms=self.policy.clock()
        )

    # -- carrying the steps out ------------------------------------------------------------

    async def _renewing(self, step: RunHandler, awaitable: Awaitable[Any]) -> Any:
        """Await the handler while its claim is renewed; a lost claim cancels it and is
        reported as :class:`~idemq.LeaseLostError`.

        The handler runs in the caller's task, which the renewal cancels when the claim is
        lost (the keeper marks the context lost and cancels in one step, so ``lease_lost``
        tells that cancel from the caller's own); that cancel is taken back
        (``Task.uncancel``) once it has become the LeaseLostError, so an ``asyncio.timeout`` or
        a task group around the call counts only its own.
        """
        if step.lease is None:
            return await awaitable
        task = asyncio.current_task()
        # Awaited outside a task (a coroutine driven by hand): the handler gets a task of its
        # own to cancel.
        running = awaitable if task is not None else asyncio.ensure_future(awaitable)
        keeping = AsyncKeeping(
            self.store.renew,
            self.policy.clock,
            step.lease,
            step.context,
            task if task is not None else cast("asyncio.Future[Any]", running),
        )
        try:
            return await running
        except asyncio.CancelledError as exc:
            if not step.context.lease_lost:
                raise  # the caller was cancelled, not the lease lost
            raise LeaseLostError(
                f"lease on {step.lease.key.message_id!r} was lost while its handler ran; "
                "the handler was cancelled"
            ) from exc
        finally:
            keeping.stop()
            if task is not None and step.context.lease_lost:
                task.uncancel()  # the renewal's cancel, delivered (or swallowed by the handler)

    async def _run(
        self,
        make_flow: Callable[[Any], Flow],
        handler: Callable[[Any, Any], Any],
        connection: Any,
        retries_type: type[ConflictRetries],
        *,
        holds: bool = False,
    ) -> Any:
        """See :meth:`Idempotency._run`."""
        retries = retries_type(owns_transaction=connection is None)
        if not self._transactional:
            if not holds:
                execute = functools.partial(self._execute, None, handler)
                return await adrive(make_flow(retries), execute)
            holding = AsyncHolding(self.store.renew, self.policy.clock)
            try:
                execute = functools.partial(self._execute, None, handler, holding=holding)
                return await adrive(make_flow(retries), execute)
            finally:
                holding.close()
        store = cast(AsyncTransactionalGuardStore, self.store)
        while True:
            try:
                async with store.transaction(connection) as tx:
                    flow = make_flow(retries)
                    return await adrive(flow, functools.partial(self._execute, tx, handler))
            except (StoreConflictError, HandlerFailedError) as exc:
                if not retries.again(exc):
                    raise

    async def _execute(
        self,
        tx: Any,
        handler: Callable[[Any, Any], Any],
        step: Step,
        *,
        holding: AsyncHolding | None = None,
    ) -> Any:
        """See :meth:`Idempotency._execute`; a plain function's result is not awaited."""
        if isinstance(step, StoreStep):
            return await step.call(self.store, tx)
        if isinstance(step, RunHandler):
            if holding is not None:
                holding.keep(step.held)
            token = context.enter(step.context)
            try:
                result = handler(step.message, tx)
                if inspect.isawaitable(result):
                    result = await self._renewing(step, result)
                return True, result
            except BaseException as exc:  # the flow decides; it re-raises what must go on
                return False, exc
            finally:
                context.leave(token)
        await asyncio.sleep(step.seconds)
        return None
