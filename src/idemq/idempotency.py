"""``Idempotency`` and ``AsyncIdempotency``: thin sync/async shells over :mod:`idemq.core`.

They only sequence store calls; what a claim means is decided in :func:`idemq.core.judge`.

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
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

from idemq.core import (
    NULL_RESULT,
    BatchPlan,
    Clock,
    Mode,
    Outcome,
    Policy,
    encode_result,
    failed,
    judge,
    plan_batch,
    processed,
)
from idemq.errors import ConfigurationError, InvalidMessageIdError, StoreConflictError
from idemq.message import Message
from idemq.observe import (
    Observer,
    Probe,
    awatch_handler,
    claim_status,
    report_batch,
    watch_handler,
)
from idemq.stores.base import (
    AsyncStore,
    AsyncTransactionalStore,
    ClaimRequest,
    Store,
    TransactionalStore,
)

__all__ = ["AsyncIdempotency", "Idempotency"]

T = TypeVar("T")
S = TypeVar("S", "Store", "AsyncStore")
CLAIM_ATTEMPTS = 5  # retries of a claim that hit a deadlock; nothing was written before it


def _mode_for(store: object, mode: str | None, transactional: bool) -> str:
    if mode is None:
        return Mode.TRANSACTIONAL if transactional else Mode.LEASE
    if mode == Mode.TRANSACTIONAL and not transactional:
        raise ConfigurationError(
            f"{type(store).__name__} cannot share a transaction with the business change; "
            'use mode="lease"'
        )
    return mode


def _key_of(key: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """Run the user's key function; a message without an id is an invalid message, not a crash."""
    try:
        return key(*args, **kwargs)
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        raise InvalidMessageIdError(f"could not extract the message id: {exc!r}") from exc


def _call_with_tx(fn: Callable[..., T]) -> Callable[..., Callable[[Any], T]]:
    """Adapt ``fn(*args, tx=…)`` (or ``fn(*args)`` if it takes no ``tx``) to ``handler(tx)``."""
    takes_tx = "tx" in inspect.signature(fn).parameters

    def bind(*args: Any, **kwargs: Any) -> Callable[[Any], T]:
        if takes_tx:
            return lambda tx: fn(*args, **kwargs, tx=tx)
        return lambda _tx: fn(*args, **kwargs)

    return bind


def _optional(fn: Callable[..., object] | None, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    return None if fn is None else fn(*args, **kw)


class _Guard(Generic[S]):
    """What the sync and the async guard share: settings, store and observer."""

    # The store protocol whose stores run handlers in the dedup transaction (the default mode).
    _transactional_protocol: ClassVar[type]

    def __init__(
        self,
        store: S,
        *,
        consumer: str = "default",
        mode: str | None = None,
        lease_s: float = 30.0,
        clock: Clock | None = None,
        observer: Observer | None = None,
    ) -> None:
        transactional = isinstance(store, self._transactional_protocol)
        mode = _mode_for(store, mode, transactional)
        self.policy = Policy.build(consumer=consumer, mode=mode, lease_s=lease_s, clock=clock)
        # Metrics/tracing/logging hooks (idemq.observe); None costs one check per message.
        self.observer = observer
        self.store: S = store

    @property
    def consumer(self) -> str:
        """The dedup scope: message ids are unique per consumer."""
        return self.policy.consumer

    @property
    def mode(self) -> Mode:
        """Transactional (dedup row in the business transaction) or lease."""
        return self.policy.mode


class Idempotency(_Guard[Store]):
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
            claims = self.store.claim_many(plan.requests)
            return plan.assemble(
                [
                    self._batch_lease_one(request, claim_outcome, msg, handler)
                    for request, claim_outcome, msg in zip(
                        plan.requests, _judged(plan.requests, claims), by_request, strict=True
                    )
                ]
            )
        # Optimistic pass first: no savepoints (they cost two statements per message). If a
        # handler raises, that transaction rolls back whole and the batch runs again, each
        # message in a savepoint; the one that raised is FAILED with its error, not rerun.
        failures: dict[int, Exception] | None = None
        for _pass in range(2):
            for attempt in range(1, CLAIM_ATTEMPTS + 1):
                try:
                    return plan.assemble(
                        self._batch_in(plan, by_request, handler, connection, failures)
                    )
                except _HandlerFailedError as exc:
                    failures = {exc.index: exc.error}
                    break
                except StoreConflictError:
                    # A deadlock rolled the whole batch back: nothing of it committed.
                    if connection is not None or attempt == CLAIM_ATTEMPTS:
                        raise
        raise AssertionError("unreachable: the isolated pass never raises _HandlerFailedError")

    def _batch_in(
        self,
        plan: BatchPlan,
        by_request: list[Message],
        handler: Callable[[Message, Any], Any],
        connection: Any,
        failures: dict[int, Exception] | None,
    ) -> list[Outcome[Any]]:
        store = cast(TransactionalStore, self.store)
        with store.transaction(connection) as tx:
            to_claim = _to_claim(plan.requests, failures)
            claims = store.claim_many_in(tx, to_claim) if to_claim else []
            outcomes = []
            for i, (request, judged, msg) in enumerate(
                zip(
                    plan.requests, _judged(plan.requests, claims, failures), by_request, strict=True
                )
            ):
                if judged is not None:
                    outcomes.append(judged)
                    continue
                if failures is None:
                    try:
                        result = _handle_and_save(store, tx, request, handler(msg, tx))
                    except Exception as exc:
                        raise _HandlerFailedError(i, exc) from exc
                    outcomes.append(processed(request, result))
                    continue
                try:
                    with store.savepoint(tx):
                        result = _handle_and_save(store, tx, request, handler(msg, tx))
                except Exception as exc:
                    store.release_in(tx, request.key, request.owner)
                    outcomes.append(failed(request, exc))
                else:
                    outcomes.append(processed(request, result))
        return outcomes

    def _batch_lease_one(
        self,
        request: ClaimRequest,
        judged: Outcome[Any] | None,
        msg: Message,
        handler: Callable[[Message, Any], Any],
    ) -> Outcome[Any]:
        if judged is not None:
            return judged
        try:
            result = handler(msg, None)
            encoded = encode_result(result)
        except Exception as exc:
            self._release(request, exc)
            return failed(request, exc)
        self.store.complete(request.key, request.owner, encoded, self.policy.clock())
        return processed(request, result)

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
            bind = _call_with_tx(fn)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Outcome[T]:
                return self.process(
                    cast(str, _key_of(key, args, kwargs)),
                    bind(*args, **kwargs),
                    business_id=_optional(business_id, args, kwargs),
                    payload=_optional(payload, args, kwargs),
                )

            return wrapper

        return decorate


class _HandlerFailedError(Exception):
    """A handler raised in the optimistic (savepoint-free) pass: rerun the batch isolated."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index  # in BatchPlan.requests
        self.error = error


def _to_claim(
    requests: list[ClaimRequest], failures: dict[int, Exception] | None
) -> list[ClaimRequest]:
    """The requests to claim: all but those whose handler already failed in this batch."""
    if not failures:
        return requests
    return [request for i, request in enumerate(requests) if i not in failures]


def _handle_and_save(
    store: TransactionalStore, tx: Any, request: ClaimRequest, result: object
) -> object:
    encoded = encode_result(result)
    if encoded != NULL_RESULT:
        store.save_result_in(tx, request.key, encoded)
    return result


async def _ahandle_and_save(
    store: AsyncTransactionalStore, tx: Any, request: ClaimRequest, result: object
) -> object:
    result = await _maybe_await(result)
    encoded = encode_result(result)
    if encoded != NULL_RESULT:
        await store.save_result_in(tx, request.key, encoded)
    return result


def _judged(
    requests: Sequence[ClaimRequest],
    claims: Sequence[Any],
    failures: dict[int, Exception] | None = None,
) -> list[Outcome[Any] | None]:
    """judge() each claim; a payload mismatch fails only that message of the batch.

    ``claims`` skips the requests in ``failures`` (handler already failed: FAILED as is)."""
    out: list[Outcome[Any] | None] = []
    claimed = iter(claims)
    for i, request in enumerate(requests):
        if failures and i in failures:
            out.append(failed(request, failures[i]))
            continue
        try:
            out.append(judge(request, next(claimed)))
        except Exception as exc:
            out.append(failed(request, exc))
    return out


class AsyncIdempotency(_Guard[AsyncStore]):
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
            outcomes: list[Outcome[Any]] = []
            claims = await self.store.claim_many(plan.requests)
            for request, judged, msg in zip(
                plan.requests, _judged(plan.requests, claims), by_request, strict=True
            ):
                outcomes.append(await self._batch_lease_one(request, judged, msg, handler))
            return plan.assemble(outcomes)
        # See Idempotency._process_batch: optimistic pass, then isolated in savepoints.
        failures: dict[int, Exception] | None = None
        for _pass in range(2):
            for attempt in range(1, CLAIM_ATTEMPTS + 1):
                try:
                    return plan.assemble(
                        await self._batch_in(plan, by_request, handler, connection, failures)
                    )
                except _HandlerFailedError as exc:
                    failures = {exc.index: exc.error}
                    break
                except StoreConflictError:
                    if connection is not None or attempt == CLAIM_ATTEMPTS:
                        raise
        raise AssertionError("unreachable: the isolated pass never raises _HandlerFailedError")

    async def _batch_in(
        self,
        plan: BatchPlan,
        by_request: list[Message],
        handler: Callable[[Message, Any], Any],
        connection: Any,
        failures: dict[int, Exception] | None,
    ) -> list[Outcome[Any]]:
        store = cast(AsyncTransactionalStore, self.store)
        outcomes: list[Outcome[Any]] = []
        async with store.transaction(connection) as tx:
            to_claim = _to_claim(plan.requests, failures)
            claims = await store.claim_many_in(tx, to_claim) if to_claim else []
            for i, (request, judged, msg) in enumerate(
                zip(
                    plan.requests, _judged(plan.requests, claims, failures), by_request, strict=True
                )
            ):
                if judged is not None:
                    outcomes.append(judged)
                    continue
                if failures is None:
                    try:
                        result = await _ahandle_and_save(store, tx, request, handler(msg, tx))
                    except Exception as exc:
                        raise _HandlerFailedError(i, exc) from exc
                    outcomes.append(processed(request, result))
                    continue
                try:
                    async with store.savepoint(tx):
                        result = await _ahandle_and_save(store, tx, request, handler(msg, tx))
                except Exception as exc:
                    await store.release_in(tx, request.key, request.owner)
                    outcomes.append(failed(request, exc))
                else:
                    outcomes.append(processed(request, result))
        return outcomes

    async def _batch_lease_one(
        self,
        request: ClaimRequest,
        judged: Outcome[Any] | None,
        msg: Message,
        handler: Callable[[Message, Any], Any],
    ) -> Outcome[Any]:
        if judged is not None:
            return judged
        try:
            result = await _maybe_await(handler(msg, None))
            encoded = encode_result(result)
        except Exception as exc:
            await self._release(request, exc)
            return failed(request, exc)
        await self.store.complete(request.key, request.owner, encoded, self.policy.clock())
        return processed(request, result)

    def idempotent(
        self,
        key: Callable[..., object],
        *,
        business_id: Callable[..., object] | None = None,
        payload: Callable[..., object] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[Outcome[Any]]]]:
        """See :meth:`Idempotency.idempotent`; the decorated function may be async."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[Outcome[Any]]]:
            bind = _call_with_tx(fn)

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Outcome[Any]:
                return await self.process(
                    cast(str, _key_of(key, args, kwargs)),
                    bind(*args, **kwargs),
                    business_id=_optional(business_id, args, kwargs),
                    payload=_optional(payload, args, kwargs),
                )

            return wrapper

        return decorate


async def _maybe_await(value: Awaitable[T] | T) -> T:
    if inspect.isawaitable(value):
        return await value
    return value
