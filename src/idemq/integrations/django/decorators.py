"""``@idempotent(consumer=…, key=…)``: a function's effect once per key, in a Django project.

For Celery tasks (put it under ``@app.task``) and plain functions alike::

    @app.task(acks_late=True)
    @idempotent(consumer="billing.pay", key="order_id")
    def pay(order_id: str, amount: int) -> dict:
        Payment.objects.create(order_id=order_id, amount=amount)   # commits with the dedup row
        return {"paid": order_id}                                 # stored, replayed for duplicates

The body runs inside ``transaction.atomic(using=…)`` with the dedup row (a ``tx=None``
parameter, if declared, gets Django's connection). A call whose key was done before returns the
stored result without running the body. ``key``: the name of an argument, a callable given the
call's arguments, or None for the running Celery task's id (its redeliveries keep it).

When another worker is running the same key right now (lease mode, or a wait that ran out),
there is no result to return: inside a Celery task the task is retried in
``in_progress_countdown_s``; elsewhere :class:`~idemq.StoreConflictError` is raised (safe to
retry).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from idemq.errors import (
    ConfigurationError,
    InvalidMessageError,
    InvalidMessageIdError,
    StoreConflictError,
)
from idemq.guard.core import Status
from idemq.guard.idempotency import Idempotency
from idemq.integrations.django.store import DjangoStore

__all__ = ["idempotent"]

F = TypeVar("F", bound=Callable[..., Any])

Key = str | Callable[..., object] | None


def idempotent(
    consumer: str,
    key: Key = None,
    *,
    using: str = "default",
    table: str | None = None,
    check_payload: bool = True,
    in_progress_countdown_s: float = 5.0,
    **guard_options: Any,
) -> Callable[[F], F]:
    """Guard a function by ``key`` for ``consumer`` on the Django database ``using`` (see the
    module). ``check_payload``: a key reused with other arguments raises
    :class:`~idemq.PayloadMismatchError` instead of replaying; ``guard_options`` go to
    :class:`~idemq.Idempotency` (``mode="lease"``, ``lease_s``, ``wait_s`` …). The store and
    guard are made at the first call, once Django's settings are loaded; the decorated
    function's ``guard()`` returns that :class:`~idemq.Idempotency` (``pay.guard().forget(key)``).
    """
    if not consumer or not isinstance(consumer, str):
        raise ConfigurationError(f"consumer must be a non-empty string, got {consumer!r}")
    if key is not None and not isinstance(key, str) and not callable(key):
        raise ConfigurationError(f"key must be an argument name, a callable or None, got {key!r}")

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        if isinstance(key, str) and key not in signature.parameters:
            raise ConfigurationError(f"{fn.__name__} has no argument named {key!r}")
        takes_tx = "tx" in signature.parameters
        guard: list[Idempotency] = []
        lock = threading.Lock()

        def guard_for() -> Idempotency:
            with lock:
                if not guard:
                    store = DjangoStore(using=using, table=table)
                    guard.append(Idempotency(store, consumer=consumer, **guard_options))
                return guard[0]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            arguments = _arguments(fn, signature, args, kwargs)
            message_id = _message_id(fn, key, args, kwargs, arguments)

            def body(tx: Any) -> Any:
                return fn(*args, **kwargs, tx=tx) if takes_tx else fn(*args, **kwargs)

            payload = arguments if check_payload else None
            outcome = guard_for().process(cast(str, message_id), body, payload=payload)
            if outcome.status is Status.IN_PROGRESS:
                _in_progress(fn, cast(str, message_id), in_progress_countdown_s)
            return outcome.result

        # The guard behind the function (made on first use): to forget a key, read its store's
        # stats, or close its store's own connections.
        wrapper.guard = guard_for  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate


def _arguments(
    fn: Callable[..., Any],
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The call's arguments by name (so ``f("o1", 10)`` and ``f(order_id="o1", amount=10)``
    are one payload), less ``tx``."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise InvalidMessageError(f"{fn.__name__}: arguments do not fit: {exc}") from exc
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "tx"}


def _message_id(
    fn: Callable[..., Any],
    key: Key,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    arguments: dict[str, Any],
) -> object:
    if key is None:
        task = _current_celery_task()
        task_id = None if task is None else task.request.id
        if not task_id:
            raise InvalidMessageIdError(
                f"{fn.__name__} runs outside a Celery task, so there is no task id to key it "
                "by: pass key= (an argument name or a callable)"
            )
        return task_id
    if isinstance(key, str):
        if key not in arguments:
            raise InvalidMessageIdError(f"{fn.__name__}: argument {key!r} is missing")
        value = arguments[key]
    else:
        try:
            value = key(*args, **kwargs)
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            raise InvalidMessageIdError(f"could not extract the message id: {exc!r}") from exc
    # An integer order id is the natural key of many tasks; anything else non-str is left to
    # the guard, which refuses it before writing anything.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _current_celery_task() -> Any:
    try:
        from celery import current_task  # noqa: PLC0415 -- Celery is optional
    except ImportError:
        return None
    return current_task if current_task else None


def _in_progress(fn: Callable[..., Any], message_id: str, countdown_s: float) -> None:
    """Another worker holds ``message_id``: returning would report a success that has not
    happened (and let a broker ack a message whose holder may still crash)."""
    task = _current_celery_task()
    if task is not None and task.request.id:
        # Waiting for a twin must not use up max_retries, which is meant for the body's own
        # failures: giving up would drop a good message.
        raise task.retry(countdown=countdown_s, max_retries=int(task.request.retries) + 1)
    raise StoreConflictError(
        f"{fn.__name__}: {message_id!r} is being run by another worker right now; call again "
        "later (its result is replayed once it is done)"
    )
