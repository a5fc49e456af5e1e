"""What the sync and the async guard share: settings, store, observer, the decorator's binding."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from idemq._clock import Clock
from idemq.errors import ConfigurationError, InvalidMessageIdError
from idemq.guard.core import Mode, Policy
from idemq.guard.probes import Observer
from idemq.stores.base import AsyncStore, Store

T = TypeVar("T")


S = TypeVar("S", "Store", "AsyncStore")


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
    return None if fn is None else fn(*args, **kw)


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
