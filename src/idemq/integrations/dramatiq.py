"""``IdempotencyMiddleware``: exactly-once effects for Dramatiq actors.

Dramatiq delivers a message at least once: a worker killed after an actor's effect but before
the ack gets the message redelivered, and a producer that re-sends after a timeout enqueues it
twice. Add the middleware to the broker and every actor's effect happens once per message::

    guard = Idempotency(SqlStore("postgresql+psycopg://…"), consumer="billing")
    broker.add_middleware(IdempotencyMiddleware(guard))

    @dramatiq.actor
    def pay(order_id: str, amount: int, tx=None) -> dict:  # tx: the dedup transaction (SQL)
        tx.execute(...)                                  # commits with the dedup row, or not at all
        return {"paid": order_id}                        # stored, replayed for duplicates

Why the actor's function is wrapped: Dramatiq's hooks run *before* and *after* the actor, in
separate calls, so no hook can hold a transaction open around it. In transactional mode the
dedup row and the actor's writes must commit together, so the actor has to run *inside*
``guard.process``. The middleware therefore wraps each actor's ``fn`` when the actor is declared
(``after_declare_actor``; actors declared before ``add_middleware`` are wrapped then), and its
``before_process_message`` hook tells the wrapper which message is being delivered. One
middleware thus covers both modes: transactional (exactly once for effects through ``tx``) and
lease (the claim taken before the actor runs and completed after it returns).

How one delivery goes:

* key: the Dramatiq message id (kept by Dramatiq's retries and by redeliveries) or
  ``key(message)``; the arguments (actor name, args, kwargs) are the payload, so a key reused
  with other arguments is refused (``check_payload=False`` turns that off).
* the actor reaches the transaction as a ``tx`` parameter (filled when it declares one; never
  sent in the message) or through :func:`current_tx`; ``None`` in lease mode.
* PROCESSED → the actor's result; DUPLICATE → the stored result, the actor does not run; both
  are acked (and stored by Dramatiq's ``Results`` middleware when it is on).
* the actor raises → rolled back / claim released, the exception propagates: Dramatiq's
  ``Retries`` middleware retries it (``max_retries``, ``throws`` … apply as usual).
* IN_PROGRESS (a twin holds the claim) or the store is unreachable → the message is enqueued
  again with a delay and this delivery is skipped and acked. It is not counted by ``Retries``:
  waiting for a twin or for the store must not use up retries meant for failures of the actor.
* invalid key or a payload clash → the message is failed (dead-lettered: Dramatiq's ``.XQ``
  queue) with the reason logged and raised as the skip's exception (the ``Results`` middleware
  stores it), since retrying cannot help. Never acked silently.

A direct call (``pay("o1", 10)``, not a delivery) runs the function unguarded: there is no
message id to key it by. Called from inside a guarded actor it gets that actor's ``tx``, so its
writes are part of the caller's effect. An actor opts out with
``@dramatiq.actor(idempotent=False)``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn

from dramatiq import Actor, Broker, Message, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from idemq.brokers.settlement import DeadLetter, Retry, RetryPolicy, Verdict, classify, decide
from idemq.errors import ConfigurationError, InvalidMessageIdError
from idemq.guard.core import Status
from idemq.guard.idempotency import Idempotency

__all__ = ["IdempotencyMiddleware", "current_tx"]

logger = logging.getLogger(__name__)

#: The actor option that turns the guard off for one actor (``idempotent=False``).
ACTOR_OPTION = "idempotent"

_current_tx: ContextVar[Any] = ContextVar("idemq_dramatiq_tx", default=None)


def current_tx() -> Any:
    """The dedup transaction's connection inside a guarded actor (``None`` in lease mode)."""
    return _current_tx.get()


@dataclass(slots=True)
class _Delivery:
    """The message a worker thread is processing, between ``before_process_message`` and the end."""

    broker: Broker
    message: MessageProxy
    guarded: bool = False  # the actor call for this delivery has entered the guard


# A worker thread processes one message at a time, and Dramatiq runs the hooks and the actor
# in that thread: a context variable hands the message to the wrapped function.
_delivery: ContextVar[_Delivery | None] = ContextVar("idemq_dramatiq_delivery", default=None)


class IdempotencyMiddleware(Middleware):
    """A Dramatiq middleware that runs every actor of its broker through ``guard`` (see module).

    ``key``: ``key(message) -> str`` (the message as Dramatiq hands it to middleware: it has
    ``message_id``, ``actor_name``, ``args``, ``kwargs``, ``options``); default: the message id.
    ``retry_policy``: its ``in_progress_delay_s`` and ``store_unavailable_delay_s`` are how
    long a message waits before it comes back while a twin holds it or the store is away.
    """

    def __init__(
        self,
        guard: Idempotency,
        key: Callable[[MessageProxy], str] | None = None,
        *,
        check_payload: bool = True,
        retry_policy: RetryPolicy | None = None,
    ) -> None:
        if not isinstance(guard, Idempotency):
            raise ConfigurationError(
                f"guard must be an idemq.Idempotency, got {type(guard).__name__}"
            )
        if key is not None and not callable(key):
            raise ConfigurationError(f"key must be a callable of the message, got {key!r}")
        self.guard = guard
        self.key = key
        self.check_payload = check_payload
        self.retry_policy = retry_policy or RetryPolicy()
        # Wrapped functions by actor name: declaring (or replaying) an actor twice must not
        # nest two guards on the same key, which would answer IN_PROGRESS to itself.
        self._wrapped: dict[str, Callable[..., Any]] = {}

    @property
    def actor_options(self) -> set[str]:
        return {ACTOR_OPTION}

    def after_declare_actor(self, broker: Broker, actor: Actor[Any, Any]) -> None:
        if actor.options.get(ACTOR_OPTION, True) is False:
            return
        if self._wrapped.get(actor.actor_name) is actor.fn:
            return
        actor.fn = self._wrap(actor.actor_name, actor.fn)
        self._wrapped[actor.actor_name] = actor.fn

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _delivery.set(_Delivery(broker, message))

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        _delivery.set(None)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        _delivery.set(None)

    # -- the guarded call ---------------------------------------------------------------------

    def _wrap(self, actor_name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        takes_tx = _declares_tx(fn)

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            delivery = _delivery.get()
            if (
                delivery is None
                or delivery.guarded
                or delivery.message.actor_name != actor_name
                or delivery.message.failed
            ):
                # A direct call: not a delivery of this actor's message (an actor called from
                # inside another, or outside a worker). Keying it by the delivery's id would
                # make it a duplicate of the outer message. Called from a guarded actor, it
                # writes through the caller's transaction: part of the caller's one effect.
                if takes_tx and "tx" not in kwargs:
                    kwargs["tx"] = _current_tx.get()
                return fn(*args, **kwargs)
            delivery.guarded = True
            try:
                return self._process(delivery, fn, takes_tx, args, kwargs)
            finally:
                delivery.guarded = False

        return guarded

    def _process(
        self,
        delivery: _Delivery,
        fn: Callable[..., Any],
        takes_tx: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        message = delivery.message

        def body(tx: Any) -> Any:
            token = _current_tx.set(tx)
            try:
                if takes_tx:
                    return fn(*args, **{**kwargs, "tx": tx})
                return fn(*args, **kwargs)
            finally:
                _current_tx.reset(token)

        payload = (
            {"actor": message.actor_name, "args": list(args), "kwargs": kwargs}
            if self.check_payload
            else None
        )
        try:
            message_id = self._message_id(message)
            outcome = self.guard.process(message_id, body, payload=payload)
        except Exception as exc:
            verdict = classify(exc)
            if verdict is Verdict.HANDLER_ERROR:
                raise  # the actor failed: Dramatiq's Retries middleware decides
            self._settle_elsewhere(delivery, verdict, str(exc), exc)
        if outcome.status is Status.IN_PROGRESS:
            self._settle_elsewhere(delivery, Verdict.IN_PROGRESS, "another worker holds it", None)
        return outcome.result

    def _message_id(self, message: MessageProxy) -> str:
        if self.key is None:
            return str(message.message_id)
        try:
            value = self.key(message)
        except Exception as exc:
            raise InvalidMessageIdError(
                f"key function failed on message {message.message_id}: {exc!r}"
            ) from exc
        return value  # validated by the guard before anything is written

    def _settle_elsewhere(
        self,
        delivery: _Delivery,
        verdict: Verdict,
        detail: str,
        cause: BaseException | None,
    ) -> NoReturn:
        """Skip this delivery, having failed the message or enqueued it again (never returns).

        Raising ``SkipMessage`` from the actor call makes the worker emit ``after_skip_message``
        instead of ``after_process_message``: Dramatiq's ``Retries`` does not count it (the
        actor did not fail), and the delivery is acked (or nacked, once failed) as usual.
        """
        message = delivery.message
        settlement = decide(verdict, 1, self.retry_policy, detail)
        if isinstance(settlement, Retry):
            delay_ms = int(settlement.delay_s * 1000)
            logger.info(
                "message %s of actor %s comes back in %d ms: %s",
                message.message_id,
                message.actor_name,
                delay_ms,
                verdict.value,
            )
            # Enqueued again before this delivery is acked: a crash in between leaves two
            # copies, which the guard tells apart; the other order could lose the message.
            delivery.broker.enqueue(_same_message(message), delay=delay_ms)
            raise SkipMessage(f"{verdict.value}: {detail}") from cause
        reason = settlement.reason if isinstance(settlement, DeadLetter) else verdict.value
        logger.error(
            "dead-lettering message %s of actor %s: %s",
            message.message_id,
            message.actor_name,
            reason,
        )
        message.fail()
        raise SkipMessage(reason) from cause


def _same_message(message: MessageProxy) -> Message[Any]:
    """The delivered message as a new ``Message`` with the same id, arguments and options."""
    return Message(
        queue_name=message.queue_name,
        actor_name=message.actor_name,
        args=message.args,
        kwargs=message.kwargs,
        options=message.options,
        message_id=message.message_id,
        message_timestamp=message.message_timestamp,
    )


def _declares_tx(fn: Callable[..., Any]) -> bool:
    try:
        return "tx" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a readable signature
        return False
