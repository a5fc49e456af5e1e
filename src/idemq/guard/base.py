"""What the sync and the async guard share: settings, store, observer, and everything around a
flow that involves no I/O — the probe of a message, the batch's plan and report, the
decorator's binding of a function to ``handler(tx)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Generic, TypeVar, cast

from idemq._clock import Clock
from idemq.errors import ConfigurationError, InvalidMessageIdError
from idemq.guard.batch_flow import BatchFlow, BatchPasses, BatchPlan, batch_flow, plan_batch
from idemq.guard.cache import DEFAULT_LOCAL_CACHE_TTL_S, CompletedCache
from idemq.guard.codec import Codec
from idemq.guard.core import Mode, Outcome, Policy, Status, processed_record
from idemq.guard.probes import Observer, Probe, report_batch
from idemq.message import Message
from idemq.stores.base import AsyncGuardStore, ClaimRequest, GuardStore

__all__ = ["GuardBase", "Observed", "bind_handler", "call_with_tx", "key_of", "optional_call"]

T = TypeVar("T")
S = TypeVar("S", "GuardStore", "AsyncGuardStore")

DecoratedCall = tuple[str, Callable[[Any], Any], dict[str, Any]]
"""What one call of an ``@idempotent`` function becomes: message id, ``handler(tx)``, options."""


def _mode_for(store: object, mode: str | None, transactional: bool) -> str:
    if mode is None:
        return Mode.TRANSACTIONAL if transactional else Mode.LEASE
    if mode == Mode.TRANSACTIONAL and not transactional:
        raise ConfigurationError(
            f"{type(store).__name__} cannot share a transaction with the business change; "
            'use mode="lease"'
        )
    return mode


def key_of(key: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """Run the user's key function; a message without an id is an invalid message, not a crash."""
    try:
        return key(*args, **kwargs)
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        raise InvalidMessageIdError(f"could not extract the message id: {exc!r}") from exc


def call_with_tx(fn: Callable[..., T]) -> Callable[..., Callable[[Any], T]]:
    """Adapt ``fn(*args, tx=…)`` (or ``fn(*args)`` if it takes no ``tx``) to ``handler(tx)``."""
    takes_tx = "tx" in inspect.signature(fn).parameters

    def bind(*args: Any, **kwargs: Any) -> Callable[[Any], T]:
        if takes_tx:
            return lambda tx: fn(*args, **kwargs, tx=tx)
        return lambda _tx: fn(*args, **kwargs)

    return bind


def optional_call(
    fn: Callable[..., object] | None, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    """``fn(*args, **kw)``, or None when the decorator was given no such function."""
    return None if fn is None else fn(*args, **kw)


def bind_handler(handler: Callable[[Any], T]) -> Callable[[Any, Any], T]:
    """``process``'s ``handler(tx)`` in the flows' form ``handler(message, tx)``."""
    return lambda _message, tx: handler(tx)


class Observed:
    """Reports a guard call's end to its probe (none: does nothing)::

    with Observed(probe) as observed:
        observed.outcome = ...   # raising instead reports the error
    """

    __slots__ = ("outcome", "probe")

    def __init__(self, probe: Probe | None) -> None:
        self.probe = probe
        self.outcome: Outcome[Any] | None = None

    def __enter__(self) -> Observed:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.probe is not None:
            self.probe.finished(None if exc is not None else self.outcome, exc)


class GuardBase(Generic[S]):
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
        codec: Codec[Any] | None = None,
        wait_s: float = 0.0,
        local_cache: int = 0,
        local_cache_ttl_s: float = DEFAULT_LOCAL_CACHE_TTL_S,
        renew: bool = True,
    ) -> None:
        transactional = isinstance(store, self._transactional_protocol)
        mode = _mode_for(store, mode, transactional)
        self.policy = Policy.build(
            consumer=consumer,
            mode=mode,
            lease_s=lease_s,
            clock=clock,
            codec=codec,
            wait_s=wait_s,
            renew=renew,
        )
        # Metrics/tracing/logging hooks (idemq.observe); None costs one check per message.
        self.observer = observer
        self.store: S = store
        self._transactional = self.policy.mode is Mode.TRANSACTIONAL
        self.cache = (
            CompletedCache(local_cache, round(local_cache_ttl_s * 1000)) if local_cache else None
        )

    @property
    def consumer(self) -> str:
        """The dedup scope: message ids are unique per consumer."""
        return self.policy.consumer

    @property
    def mode(self) -> Mode:
        """Transactional (dedup row in the business transaction) or lease."""
        return self.policy.mode

    def _observed(self, message_id: object) -> Observed:
        """The probe of one message, begun just before its claim (none without an observer)."""
        observer = self.observer
        probe = None if observer is None else observer.begin(self.policy.consumer, str(message_id))
        return Observed(probe)

    def _batch(
        self, messages: Sequence[Message]
    ) -> tuple[BatchPlan, Callable[[BatchPasses], BatchFlow]]:
        """The batch reduced to one request per distinct id, and how to make each pass's flow."""
        plan = plan_batch(self.policy, messages)
        by_request = [messages[i] for i in plan.first_index]

        def make_flow(passes: BatchPasses) -> BatchFlow:
            return batch_flow(
                self.policy, plan, by_request, isolated=passes.isolated, failures=passes.failures
            )

        return plan, make_flow

    @staticmethod
    def _call_for(
        fn: Callable[..., Any],
        *,
        key: Callable[..., object],
        business_id: Callable[..., object] | None,
        payload: Callable[..., object] | None,
    ) -> Callable[
        [tuple[Any, ...], dict[str, Any]], tuple[str, Callable[[Any], Any], dict[str, Any]]
    ]:
        """For ``@idempotent(key=…)`` on ``fn``: what ``process`` is called with for one call of
        the decorated function — message id, ``handler(tx)``, and keyword options."""
        bind = call_with_tx(fn)

        def call_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> DecoratedCall:
            options = {
                "business_id": optional_call(business_id, args, kwargs),
                "payload": optional_call(payload, args, kwargs),
            }
            return cast(str, key_of(key, args, kwargs)), bind(*args, **kwargs), options

        return call_for

    def _remember(
        self, request: ClaimRequest, outcome: Outcome[Any], *, committed: bool = True
    ) -> None:
        """Keep a completed message in the local cache, once its record cannot be undone:
        ``committed`` is False when the effect is inside a caller's transaction."""
        cache = self.cache
        if cache is None:
            return
        if outcome.status is Status.DUPLICATE and outcome.record is not None:
            cache.put(outcome.record, request.now_ms)
        elif outcome.status is Status.PROCESSED and committed:
            cache.put(processed_record(self.policy, request, outcome.result), request.now_ms)

    def _report_batch(self, outcomes: list[Outcome[Any]]) -> list[Outcome[Any]]:
        """Tell the observer each message's end result; returns the outcomes."""
        if self.observer is not None:
            report_batch(self.observer, self.policy.consumer, outcomes)
        return outcomes
