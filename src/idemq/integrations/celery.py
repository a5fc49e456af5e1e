"""Idempotent Celery tasks: ``@idempotent_task(app, guard, key="order_id")`` or ``IdempotentTask``.

Celery delivers a task at least once: with ``acks_late`` a worker that dies mid-task gets the
message redelivered, and a client that retries ``apply_async`` after a timeout sends it twice.
The guard makes the body's effect happen once per key::

    guard = Idempotency(SqlStore("postgresql+psycopg://…"), consumer="billing.pay")

    @idempotent_task(app, guard, key="order_id")
    def pay(order_id: str, amount: int, tx=None) -> dict:  # tx: the dedup transaction (SQL)
        tx.execute(...)                                  # commits with the dedup row, or not at all
        return {"paid": order_id}                        # stored, replayed for duplicates

* key: the task id (``self.request.id``) by default — redeliveries and ``self.retry`` keep it —
  or a named argument of the task, for producers that cannot fix the task id.
* DUPLICATE → the stored result is returned, the body does not run.
* IN_PROGRESS (another worker holds the lease) → ``self.retry(countdown=in_progress_countdown_s)``.
* the body raises → the dedup transaction rolls back / the lease is released, and the exception
  propagates, so the task's own retry policy (``autoretry_for``, ``self.retry``) applies.
* store unreachable → ``self.retry(countdown=store_unavailable_countdown_s)``.
* invalid key, payload clash → the task fails (retrying cannot help).

Keys are per guard ``consumer``: give each task its own consumer, or two tasks keyed by the same
``order_id`` would count as one message.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from celery import Celery, Task

from idemq.errors import (
    ConfigurationError,
    InvalidMessageError,
    InvalidMessageIdError,
    StoreUnavailableError,
)
from idemq.guard.core import Status
from idemq.guard.idempotency import Idempotency

__all__ = ["IdempotentTask", "current_tx", "idempotent_task"]

F = TypeVar("F", bound=Callable[..., Any])

_current_tx: ContextVar[Any] = ContextVar("idemq_celery_tx", default=None)


def current_tx() -> Any:
    """The dedup transaction's connection inside a guarded task body (``None`` in lease mode)."""
    return _current_tx.get()


class IdempotentTask(Task):  # type: ignore[misc]
    """A Celery task base whose body runs through ``idempotency_guard``.

    The body reaches the dedup transaction with :func:`current_tx` (``idempotent_task`` also
    fills a ``tx=None`` parameter from it).

    Set the class attributes (or pass them to ``app.task(base=IdempotentTask, …)``):
    ``idempotency_guard`` (an :class:`~idemq.Idempotency`), ``idempotency_key`` (an argument
    name, or ``None`` for the task id), ``in_progress_countdown_s``,
    ``store_unavailable_countdown_s``, ``idempotency_check_payload`` (hash the arguments so a
    reused key with other arguments is refused). ``acks_late`` is on: acking before the effect
    committed would lose the message on a crash.
    """

    acks_late = True
    idempotency_guard: Idempotency | None = None
    idempotency_key: str | None = None
    idempotency_check_payload = True
    in_progress_countdown_s = 5.0
    store_unavailable_countdown_s = 2.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        guard = self.idempotency_guard
        if not isinstance(guard, Idempotency):
            raise ConfigurationError(
                f"task {self.name}: idempotency_guard must be an idemq.Idempotency, got {guard!r}"
            )
        run = super().__call__

        def body(tx: Any) -> Any:
            # tx travels in a contextvar, never in kwargs: Celery records the call's kwargs in
            # the request and re-sends them on self.retry/autoretry, and a connection cannot
            # be serialized (nor outlive this transaction).
            token = _current_tx.set(tx)
            try:
                return run(*args, **kwargs)
            finally:
                _current_tx.reset(token)

        arguments = self._arguments(args, kwargs)
        # Hash the arguments by name, so pay("o1", 10) and pay(order_id="o1", amount=10) agree.
        payload = arguments if self.idempotency_check_payload else None
        try:
            message_id = cast(str, self._message_id(arguments))  # validated by the guard
            outcome = guard.process(message_id, body, payload=payload)
        except StoreUnavailableError as exc:
            # The message is fine; only the dedup store is away. Come back, do not fail it.
            raise self.retry(
                exc=exc, countdown=self.store_unavailable_countdown_s, max_retries=self._unbounded()
            ) from exc
        if outcome.status is Status.IN_PROGRESS:
            # Another worker is running this key right now; returning would report a success
            # that has not happened, and acking would lose it if that worker crashes.
            raise self.retry(countdown=self.in_progress_countdown_s, max_retries=self._unbounded())
        return outcome.result

    def _unbounded(self) -> int:
        """A max_retries this retry cannot exceed.

        Waiting for a twin (bounded by its lease) or for the store must not use up the task's
        ``max_retries``, which is meant for failures of the body: giving up would drop a good
        message. Celery still counts these retries in ``request.retries``.
        """
        return int(self.request.retries) + 1

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = inspect.signature(self.run).bind_partial(*args, **kwargs)
        except TypeError as exc:
            raise InvalidMessageError(f"task {self.name}: arguments do not fit: {exc}") from exc
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k != "tx"}

    def _message_id(self, arguments: dict[str, Any]) -> object:
        if self.idempotency_key is None:
            task_id = self.request.id
            if not task_id:
                raise InvalidMessageIdError(
                    f"task {self.name} was called directly (no task id); pass a key argument"
                )
            return task_id
        if self.idempotency_key not in arguments:
            raise InvalidMessageIdError(
                f"task {self.name}: argument {self.idempotency_key!r} is missing"
            )
        value = arguments[self.idempotency_key]
        # An integer order id is the natural key of many tasks; anything else non-str is
        # left to the guard, which refuses it before writing anything.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value


def idempotent_task(
    app: Celery,
    guard: Idempotency,
    *,
    key: str | None = None,
    in_progress_countdown_s: float = 5.0,
    store_unavailable_countdown_s: float = 2.0,
    check_payload: bool = True,
    **task_options: Any,
) -> Callable[[F], Any]:
    """Register ``fn`` as an ``acks_late`` task of ``app`` guarded by ``guard`` (see the module).

    ``key``: the name of the argument that identifies the message (default: the task id).
    ``task_options`` go to ``app.task`` (``name``, ``autoretry_for``, ``max_retries`` …); the task
    is registered with ``app`` only (``shared=False`` unless given).
    """
    if not isinstance(guard, Idempotency):
        raise ConfigurationError(f"guard must be an idemq.Idempotency, got {type(guard).__name__}")

    def decorate(fn: F) -> Any:
        params = inspect.signature(fn).parameters
        if key is not None and key not in params:
            raise ConfigurationError(f"{fn.__name__} has no argument named {key!r}")
        if "tx" in params and params["tx"].default is inspect.Parameter.empty:
            # Celery checks the caller's arguments against the signature; callers never pass tx.
            raise ConfigurationError(f"{fn.__name__}: declare the transaction as `tx=None`")
        if "tx" in params:

            @functools.wraps(fn)
            def with_tx(*args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("tx", _current_tx.get())
                return fn(*args, **kwargs)

            task_fn: Callable[..., Any] = with_tx
        else:
            task_fn = fn
        # The task belongs to ``app`` and its guard. Celery's default (shared=True) would also
        # add it to every app made later in the process, with this guard's store.
        task_options.setdefault("shared", False)
        return app.task(
            base=IdempotentTask,
            acks_late=True,
            idempotency_guard=guard,
            idempotency_key=key,
            idempotency_check_payload=check_payload,
            in_progress_countdown_s=in_progress_countdown_s,
            store_unavailable_countdown_s=store_unavailable_countdown_s,
            **task_options,
        )(task_fn)

    return decorate
