"""``IdempotencyMiddleware``: exactly-once effects for FastStream (≥ 0.7) subscribers.

Register it on a broker or router; it wraps every subscriber call of that broker/router::

    guard = AsyncIdempotency(AsyncSqlStore("postgresql+psycopg://…"), consumer="orders")
    broker = RabbitBroker(url, middlewares=[IdempotencyMiddleware(guard)])

    @broker.subscriber("orders")
    async def pay(order: dict, tx: AsyncConnection = Context(TX_CONTEXT_KEY)) -> dict:
        await tx.execute(...)       # committed together with the dedup row, or not at all

How one delivery goes (FastStream 0.7 runs broker middlewares' ``consume_scope`` inside its own
AcknowledgementMiddleware, around the decoded handler call):

1. message id = ``key(decoded body)`` if given, else the broker's id (AMQP ``message_id``, NATS
   ``Nats-Msg-Id``), else the ``idemq-message-id`` header; none → dead-letter at once.
2. ``guard.process(id, handler)``: in transactional mode the handler runs inside the dedup
   transaction, reachable as ``Context("idemq_tx")`` or :func:`current_tx`.
3. the delivery is settled here, once, after the commit, by :func:`idemq.brokers.base.decide`:
   PROCESSED/DUPLICATE → ack; IN_PROGRESS, store outage → retry later; handler error → retry,
   dead-letter after ``max_attempts``; invalid id/body, payload clash → dead-letter now.
   Anything but an ack then raises FastStream's ``SkipMessage``: no reply or ``@publisher``
   output is sent for a message whose effect did not happen, and FastStream settles nothing more.

With ``outbox=`` (an :class:`~idemq.AsyncOutbox` on the guard's database), every publish the
handler makes while it runs (``await broker.publish(…)``, ``await publisher.publish(…)``) is not
sent but added to the outbox in the dedup transaction, with an id derived from the incoming
message: it leaves (through ``idemq relay``) if and only if the transaction commits.

A ``@publisher`` decorator's output is handed over by FastStream after the handler returned,
after the commit. With ``outbox=`` it goes into the outbox too, in a transaction of its own,
under an id derived from the incoming message and the output's place, and the delivery is acked
only once it is there. A crash in between leaves the delivery unacked: it comes back, the
guard answers DUPLICATE with the stored result, FastStream hands the same output over again,
and the outbox keeps the row it already has. Each output thus leaves once, under one id, for a
message whose effect committed, and never for one whose effect did not.

``broker.request()`` works through a guarded broker: the subscriber's reply is its result, sent
directly (the requester waits for it), and a duplicate request gets the stored result; the
reply arriving at the requester passes the middleware untouched.

Subscribers must not use ``AckPolicy.ACK_FIRST`` (the message would be acked before its effect
committed); the middleware refuses such messages with :class:`~idemq.ConfigurationError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from faststream import BaseMiddleware
from faststream.exceptions import IgnoredException, SkipMessage
from faststream.message import SourceType, encode_message
from faststream.response import PublishType

from idemq.brokers.base import dead_letter_headers, decode
from idemq.brokers.settlement import (
    Ack,
    DeadLetter,
    RetryPolicy,
    Settlement,
    Verdict,
    classify,
    decide,
)
from idemq.drivers.sql import translated
from idemq.errors import (
    ConfigurationError,
    InvalidBusinessIdError,
    InvalidInputError,
    InvalidMessageError,
    InvalidMessageIdError,
)
from idemq.guard.core import Status
from idemq.guard.idempotency_async import AsyncIdempotency
from idemq.message import BUSINESS_ID_HEADER
from idemq.outbox.ids import derived_id

from ._faststream_brokers import Family, family_of

__all__ = ["TX_CONTEXT_KEY", "DeadLetterHook", "IdempotencyMiddleware", "current_tx"]

TX_CONTEXT_KEY = "idemq_tx"
"""The FastStream context key of the dedup transaction: ``tx = Context("idemq_tx")``."""

DeadLetterHook = Callable[[Any, str, dict[str, str]], Awaitable[None]]
"""``async def hook(message, reason, headers)``: keep a copy of a message before it is dropped
(e.g. publish it to a dead-letter topic with ``headers``, which carry the reason)."""

logger = logging.getLogger("idemq.integrations.faststream")

_current_tx: ContextVar[Any] = ContextVar("idemq_tx", default=None)
_FAILURE_MEMORY = 10_000  # ids whose failures are remembered (brokers that count none)


def current_tx() -> Any:
    """The dedup transaction's connection inside a guarded handler (``None`` in lease mode)."""
    return _current_tx.get()


@dataclass(slots=True)
class _Output:
    """A guarded delivery whose effect committed and whose ack waits for its ``@publisher``
    output to be in the outbox."""

    msg: Any  # FastStream's StreamMessage, to settle
    family: Family
    message_id: str
    outputs: int = 0  # outputs added so far: the next one's place


@dataclass(frozen=True, slots=True)
class _Identified:
    message_id: str
    business_id: str | None


class _Failures:
    """Failed handler runs per message id seen by this process: the attempt number.

    Not the broker's delivery count (``x-delivery-count``, ``num_delivered``, the pending
    count): it also counts the redeliveries a store outage or a twin's lease caused. A bounded
    in-process count stops a poison message from cycling forever; it restarts at zero with the
    process and is kept per process, so ``max_attempts`` is a floor, not an exact number.
    """

    def __init__(self, limit: int = _FAILURE_MEMORY) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._limit = limit

    def bump(self, message_id: str) -> int:
        count = self._counts.pop(message_id, 0) + 1
        self._counts[message_id] = count
        while len(self._counts) > self._limit:
            self._counts.popitem(last=False)
        return count

    def forget(self, message_id: str) -> None:
        self._counts.pop(message_id, None)


class IdempotencyMiddleware:
    """A FastStream broker middleware that runs each subscriber call through an idemq guard.

    ``guard``: an :class:`~idemq.AsyncIdempotency` (transactional over ``AsyncSqlStore``, or lease).
    ``key``: ``key(decoded_body) -> str`` picks the message id from the body instead of the broker.
    ``business_id``: ``business_id(decoded_body) -> str | None`` (default: the
    ``idemq-business-id`` header). ``max_attempts``: handler failures before dead-lettering.
    ``retry_policy``: delays (its ``max_attempts`` is replaced by the argument above).
    ``on_dead_letter``: see :data:`DeadLetterHook`; without it a dead message is rejected (RabbitMQ
    → the queue's DLX, NATS → TERM) or, where the broker cannot reject, acked and logged.
    ``check_payload``: hash the raw body so a reused id with another body is refused.
    ``outbox``: an :class:`~idemq.AsyncOutbox`; the handler's publishes go into it (see the
    module docstring).
    """

    def __init__(
        self,
        guard: AsyncIdempotency,
        key: Callable[[Any], object] | None = None,
        business_id: Callable[[Any], object] | None = None,
        max_attempts: int = 5,
        *,
        retry_policy: RetryPolicy | None = None,
        on_dead_letter: DeadLetterHook | None = None,
        check_payload: bool = True,
        outbox: Any = None,
    ) -> None:
        if not isinstance(guard, AsyncIdempotency):
            raise ConfigurationError(
                "IdempotencyMiddleware needs an AsyncIdempotency (FastStream handlers are async), "
                f"got {type(guard).__name__}"
            )
        if max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be >= 1, got {max_attempts}")
        base = retry_policy or RetryPolicy()
        self.guard = guard
        self.key = key
        self.business_id = business_id
        self.retry_policy = RetryPolicy(
            max_attempts=max_attempts,
            backoff_base_s=base.backoff_base_s,
            backoff_max_s=base.backoff_max_s,
            in_progress_delay_s=base.in_progress_delay_s,
            store_unavailable_delay_s=base.store_unavailable_delay_s,
        )
        self.on_dead_letter = on_dead_letter
        self.check_payload = check_payload
        self.outbox = outbox
        self._failures = _Failures()

    def __call__(self, msg: Any, /, *, context: Any) -> BaseMiddleware:
        """FastStream builds one middleware object per received message through this."""
        return _Scope(msg, context=context, owner=self)

    async def consume(
        self, call_next: Callable[[Any], Awaitable[Any]], msg: Any, context: Any, scope: _Scope
    ) -> Any:
        """Guard, run and settle one delivery (see the module docstring)."""
        family = family_of(msg)
        _refuse_ack_first(msg, family, context)
        while True:
            settlement, message_id, result = await self._attempt(call_next, msg, context, family)
            if isinstance(settlement, Ack):
                if self.outbox is None or message_id is None:
                    await msg.ack()
                else:  # acked by the scope, once FastStream handed over the outputs
                    scope.output = _Output(msg, family, message_id)
                return result
            if isinstance(settlement, DeadLetter):
                await self._dead_letter(msg, family, settlement.reason, message_id)
                raise SkipMessage
            if family.redelivers:
                await family.retry(msg, settlement.delay_s)
                raise SkipMessage
            # MQTT and friends cannot nack: wait here and run the guard again.
            await asyncio.sleep(settlement.delay_s)

    async def _attempt(
        self, call_next: Callable[[Any], Awaitable[Any]], msg: Any, context: Any, family: Family
    ) -> tuple[Settlement, str | None, Any]:
        message_id: str | None = None

        async def handler(tx: Any) -> Any:
            token = _current_tx.set(tx)
            try:
                with context.scope(TX_CONTEXT_KEY, tx):
                    return await call_next(msg)
            finally:
                _current_tx.reset(token)

        try:
            ident = await self._identify(msg, family)
            message_id = ident.message_id
            outcome = await self.guard.process(
                ident.message_id,
                handler,
                business_id=ident.business_id,
                payload=msg.body if self.check_payload else None,
            )
        except IgnoredException:
            # The handler raised FastStream's Ack/Nack/Reject/SkipMessage: it took settlement
            # into its own hands (the dedup transaction was rolled back, the claim released).
            raise
        except Exception as exc:
            verdict = classify(exc)
            attempt = 1
            if verdict is Verdict.HANDLER_ERROR and message_id is not None:
                # idemq's own count of failed runs, not the broker's delivery count: that one
                # also counts the redeliveries an outage or a busy lease caused, which must
                # never bring a message closer to the dead letters.
                attempt = self._failures.bump(message_id)
            logger.warning(
                "idemq: message %r failed (%s, attempt %d): %r",
                message_id,
                verdict.value,
                attempt,
                exc,
                exc_info=verdict is Verdict.HANDLER_ERROR,
            )
            return decide(verdict, attempt, self.retry_policy, repr(exc)), message_id, None
        if outcome.status is Status.IN_PROGRESS:
            return decide(Verdict.IN_PROGRESS, 1, self.retry_policy), message_id, None
        self._failures.forget(outcome.message_id)
        return Ack(), message_id, outcome.result

    async def add_output(self, output: _Output, cmd: Any) -> None:
        """Put one ``@publisher`` output of a committed delivery into the outbox, under the id
        its place gives it (a rerun's copy of it finds its row there and adds nothing)."""
        message_id = derived_id(self.guard.consumer, output.message_id, f"output-{output.outputs}")
        output.outputs += 1
        body, headers = _outgoing(cmd)
        # The begin and the commit translated here; add translates its own statements.
        with translated(f"outbox add to {self.outbox.table}"):
            async with self.outbox.engine.begin() as conn:
                await self.outbox.add(
                    conn, cmd.destination, body, headers=headers, message_id=message_id
                )

    async def settle_output(self, output: _Output, *, failed: bool) -> None:
        """Ack a delivery whose outputs are in the outbox; one whose output could not be put
        there is delivered again (its replayed result gives the same outputs)."""
        if not failed:
            await output.msg.ack()
            return
        logger.warning(
            "idemq: the @publisher output of %r is not in the outbox yet; delivering it again",
            output.message_id,
        )
        if output.family.redelivers:
            await output.family.retry(output.msg, self.retry_policy.store_unavailable_delay_s)

    async def _identify(self, msg: Any, family: Family) -> _Identified:
        """The dedup key and business id; InvalidMessage(Id)Error means dead-letter now."""
        headers = _str_headers(msg.headers)
        body: Any = None
        if self.key is not None or self.business_id is not None:
            try:
                body = await msg.decode()
            except Exception as exc:
                raise InvalidMessageError(f"body cannot be decoded: {exc!r}") from exc
        if self.key is None:
            # decode() owns the precedence rule shared with `idemq worker`: the broker's id,
            # then the idemq-message-id header (the body is not needed for that).
            message, error = decode(b"", headers, broker_message_id=family.broker_message_id(msg))
            if message is None:
                raise InvalidMessageIdError(error or "no message id")
            message_id: object = message.id
        else:
            message_id = _call_user(self.key, body, InvalidMessageIdError, "message id")
        if self.business_id is None:
            business_id: object = headers.get(BUSINESS_ID_HEADER) or None
        else:
            business_id = _call_user(self.business_id, body, InvalidBusinessIdError, "business id")
        # The guard validates both (type, length, characters) in one place, before any write.
        return _Identified(message_id, business_id)  # type: ignore[arg-type]

    async def _dead_letter(
        self, msg: Any, family: Family, reason: str, message_id: str | None
    ) -> None:
        if message_id is not None:
            self._failures.forget(message_id)
        logger.error(
            "idemq: dead-lettering message %r from %r: %s", message_id, family.source(msg), reason
        )
        if self.on_dead_letter is not None:
            headers = dead_letter_headers(
                _str_headers(msg.headers),
                reason=reason,
                queue=family.source(msg),
                delivery_attempt=max(await family.broker_attempt(msg), 1),
            )
            try:
                await self.on_dead_letter(msg, reason, headers)
            except Exception:
                # Dropping it now would lose the only copy: leave it to be delivered again.
                logger.exception("idemq: on_dead_letter failed for %r; retrying later", message_id)
                await family.retry(msg, self.retry_policy.store_unavailable_delay_s)
                return
        await family.dead_letter(msg)


def _refuse_ack_first(msg: Any, family: Family, context: Any) -> None:
    """Refuse a message the broker or FastStream already acknowledged (``AckPolicy.ACK_FIRST``).

    Acked before the effect committed, a crash now would lose it; silently running the guard
    anyway would advertise a guarantee that does not hold. FastStream 0.7 shows ACK_FIRST three
    ways: a ``committed`` status (Kafka auto-commit, the ACK_FIRST middleware), a no-ack AMQP
    delivery (RabbitMQ consumes with ``no_ack``), and the subscriber's ``ack_policy``.
    """
    subscriber = context.get_local("handler_")
    policy = getattr(subscriber, "ack_policy", None)
    if msg.committed is not None or family.settled_on_arrival(msg) or policy == "ack_first":
        raise ConfigurationError(
            "message was acknowledged before idemq ran (AckPolicy.ACK_FIRST): a subscriber "
            "behind IdempotencyMiddleware needs AckPolicy.ACK, REJECT_ON_ERROR, NACK_ON_ERROR "
            "or MANUAL (Kafka subscribers default to ACK_FIRST)"
        )


def _str_headers(headers: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (headers or {}).items()}


def _call_user(
    fn: Callable[[Any], object], body: Any, error: type[InvalidInputError], what: str
) -> object:
    """A key function that cannot find its field means an invalid message, not a crash."""
    try:
        return fn(body)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        raise error(f"could not extract the {what}: {exc!r}") from exc


class _Scope(BaseMiddleware):
    """The per-message middleware object FastStream enters; delegates to its owner."""

    def __init__(self, msg: Any, /, *, context: Any, owner: IdempotencyMiddleware) -> None:
        super().__init__(msg, context=context)
        self._owner = owner
        self.output: _Output | None = None  # set once the delivery's effect committed

    async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any) -> Any:
        if msg.source_type is SourceType.RESPONSE:
            # The reply to this process's own ``broker.request()``: not a delivery to guard.
            return await call_next(msg)
        return await self._owner.consume(call_next, msg, self.context, self)

    async def publish_scope(self, call_next: Callable[[Any], Awaitable[Any]], cmd: Any) -> Any:
        outbox = self._owner.outbox
        tx = current_tx()
        if outbox is not None and tx is not None:
            # Inside a guarded handler: it leaves only if the dedup transaction commits.
            body, headers = _outgoing(cmd)
            await outbox.add(tx, cmd.destination, body, headers=headers)
            return None
        if self.output is not None and cmd.publish_type is PublishType.PUBLISH:
            await self._owner.add_output(self.output, cmd)  # a @publisher's, after the commit
            return None
        return await call_next(cmd)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> bool | None:
        output, self.output = self.output, None
        if output is not None:
            await self._owner.settle_output(output, failed=exc_type is not None)
        return False


def _outgoing(cmd: Any) -> tuple[bytes, dict[str, str]]:
    """A FastStream publish command's body and headers as the outbox keeps them."""
    body, content_type = encode_message(cmd.body, None)
    headers = _str_headers(cmd.headers)
    if content_type:
        headers.setdefault("content-type", content_type)
    return body, headers
