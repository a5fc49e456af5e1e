"""``AsyncIdempotency``: the asyncio twin of :mod:`idemq.guard.idempotency`.

Same flows, same arguments, same decisions (those live in :mod:`idemq.guard.core` and
:mod:`idemq.guard.batch_flow`); only the store calls and the handler are awaited. Handlers may be
coroutine functions or plain functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
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
from idemq.guard.probes import Probe, awatch_handler, claim_status, report_batch
from idemq.message import Message
from idemq.stores.base import AsyncStore, AsyncTransactionalStore, Claim, ClaimRequest

__all__ = ["AsyncIdempotency"]

T = TypeVar("T")


class AsyncIdempotency(GuardBase[AsyncStore]):
    """The asyncio twin of :class:`Idempotency`: same arguments, ``await guard.process(...)``.

    ``handler`` may be a coroutine function or a plain function.
    """

    _transactional_protocol = AsyncTransactionalStore

    async def process(
        self,
        message_id: str,
        handler: Callable[[Any], Awaitable[T] | T],
        *,
        business_id: str | None = None,
        payload: object = None,
        connection: Any = None,
    ) -> Outcome[T]:
        """See :meth:`Idempotency.process`."""
        observer = self.observer
        if observer is None:
            return await self._process(message_id, handler, business_id, payload, connection)
        probe = observer.begin(self.policy.consumer, str(message_id))
        try:
            watched: Callable[[Any], Awaitable[T]] = awatch_handler(probe, handler)
            outcome: Outcome[T] = await self._process(
                message_id, watched, business_id, payload, connection, probe
            )
        except BaseException as exc:
            probe.finished(None, exc)
            raise
        probe.finished(outcome, None)
        return outcome

    async def _process(  # noqa: PLR0917 - private, called from process() only
        self,
        message_id: str,
        handler: Callable[[Any], Awaitable[T] | T],
        business_id: str | None,
        payload: object,
        connection: Any,
        probe: Probe | None = None,
    ) -> Outcome[T]:
        request = self.policy.request(message_id, business_id, payload)
        if self.policy.mode is Mode.LEASE:
            return await self._process_lease(request, handler, probe)
        if connection is not None:
            return await self._process_in(request, handler, connection, probe)
        for attempt in range(1, CLAIM_ATTEMPTS + 1):
            try:
                return await self._process_in(request, handler, None, probe)
            except StoreConflictError:
                if attempt == CLAIM_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    async def _process_in(
        self,
        request: ClaimRequest,
        handler: Callable[[Any], Awaitable[T] | T],
        connection: Any,
        probe: Probe | None,
    ) -> Outcome[T]:
        store = cast(AsyncTransactionalStore, self.store)
        async with store.transaction(connection) as tx:
            claim = await store.claim_in(tx, request)
            if probe is not None:
                probe.claimed(claim_status(claim))
            outcome = judge(request, claim)
            if outcome is not None:
                return outcome
            result = await _maybe_await(handler(tx))
            encoded = encode_result(result)
            if encoded != NULL_RESULT:
                await store.save_result_in(tx, request.key, encoded)
        return processed(request, result)

    async def _process_lease(
        self,
        request: ClaimRequest,
        handler: Callable[[Any], Awaitable[T] | T],
        probe: Probe | None,
    ) -> Outcome[T]:
        store = self.store
        claim = await store.claim(request)
        if probe is not None:
            probe.claimed(claim_status(claim))
        outcome = judge(request, claim)
        if outcome is not None:
            return outcome
        try:
            result = await _maybe_await(handler(None))
            encoded = encode_result(result)
        except BaseException as exc:
            await self._release(request, exc)
            raise
        await store.complete(request.key, request.owner, encoded, self.policy.clock())
        return processed(request, result)

    async def _release(self, request: ClaimRequest, cause: BaseException) -> None:
        try:
            await self.store.release(request.key, request.owner)
        except Exception as exc:
            cause.add_note(f"idemq: releasing the claim failed too ({exc!r}); it will expire")

    async def process_batch(
        self,
        messages: Sequence[Message],
        handler: Callable[[Message, Any], Any],
        *,
        connection: Any = None,
    ) -> list[Outcome[Any]]:
        """See :meth:`Idempotency.process_batch`."""
        outcomes = await self._process_batch(messages, handler, connection)
        if self.observer is not None:
            report_batch(self.observer, self.policy.consumer, outcomes)
        return outcomes

    async def _process_batch(
        self, messages: Sequence[Message], handler: Callable[[Message, Any], Any], connection: Any
    ) -> list[Outcome[Any]]:
        plan = plan_batch(self.policy, messages)
        by_request = [messages[i] for i in plan.first_index]
        if self.policy.mode is Mode.LEASE:
            flow = batch_flow(plan, by_request, isolated=True)
            return plan.assemble(
                await _adrive(
                    flow, self.store.claim_many, lambda step: self._handle_leased(handler, step)
                )
            )
        passes = BatchPasses(owns_transaction=connection is None)
        while True:
            try:
                return plan.assemble(
                    await self._batch_in(plan, by_request, handler, connection, passes)
                )
            except (HandlerFailedError, StoreConflictError) as exc:
                if not passes.again(exc):
                    raise

    async def _batch_in(
        self,
        plan: BatchPlan,
        by_request: list[Message],
        handler: Callable[[Message, Any], Any],
        connection: Any,
        passes: BatchPasses,
    ) -> list[Outcome[Any]]:
        store = cast(AsyncTransactionalStore, self.store)
        flow = batch_flow(plan, by_request, isolated=passes.isolated, failures=passes.failures)
        async with store.transaction(connection) as tx:
            return await _adrive(
                flow,
                lambda requests: store.claim_many_in(tx, requests),
                lambda step: self._handle_in(tx, handler, step),
            )

    async def _handle_in(
        self, tx: Any, handler: Callable[[Message, Any], Any], step: Handle
    ) -> tuple[bool, Any]:
        store = cast(AsyncTransactionalStore, self.store)
        request = step.request
        try:
            async with store.savepoint(tx) if step.isolated else nullcontext():
                result = await _ahandle_and_save(store, tx, request, handler(step.message, tx))
        except Exception as exc:
            if step.isolated:
                await store.release_in(tx, request.key, request.owner)
            return False, exc
        return True, result

    async def _handle_leased(
        self, handler: Callable[[Message, Any], Any], step: Handle
    ) -> tuple[bool, Any]:
        request = step.request
        try:
            result = await _maybe_await(handler(step.message, None))
            encoded = encode_result(result)
        except Exception as exc:
            await self._release(request, exc)
            return False, exc
        await self.store.complete(request.key, request.owner, encoded, self.policy.clock())
        return True, result

    def idempotent(
        self,
        key: Callable[..., object],
        *,
        business_id: Callable[..., object] | None = None,
        payload: Callable[..., object] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[Outcome[Any]]]]:
        """See :meth:`Idempotency.idempotent`; the decorated function may be async."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[Outcome[Any]]]:
            bind = call_with_tx(fn)

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Outcome[Any]:
                return await self.process(
                    cast(str, key_of(key, args, kwargs)),
                    bind(*args, **kwargs),
                    business_id=optional_call(business_id, args, kwargs),
                    payload=optional_call(payload, args, kwargs),
                )

            return wrapper

        return decorate


async def _maybe_await(value: Awaitable[T] | T) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


async def _ahandle_and_save(
    store: AsyncTransactionalStore, tx: Any, request: ClaimRequest, result: object
) -> object:
    result = await _maybe_await(result)
    encoded = encode_result(result)
    if encoded != NULL_RESULT:
        await store.save_result_in(tx, request.key, encoded)
    return result


async def _adrive(
    flow: Flow,
    claim: Callable[[list[ClaimRequest]], Awaitable[list[Claim]]],
    handle: Callable[[Handle], Awaitable[tuple[bool, Any]]],
) -> list[Outcome[Any]]:
    """:func:`idemq.guard.idempotency._drive` for the async guard."""
    reply: Any = None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            return cast(list[Outcome[Any]], stop.value)
        reply = await (claim(step) if isinstance(step, list) else handle(step))
