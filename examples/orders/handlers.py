"""Handlers of the order service: dedup guard + state machine + debit, in one transaction.

A message body is JSON: ``{"event": "pay" | "ship", "order_id": "o-1"}``. A handler runs inside
the dedup transaction (``tx``), so the dedup row, the order's transition and the debit commit or
roll back together::

    guard.process(msg.id, lambda tx: handle(msg, tx), business_id=..., payload=msg.body)

or, from the command line, ``idemq worker examples.orders.handlers:handle --broker … --store …``
(tables prefixed by ``$IDEMQ_ORDERS_PREFIX``, default none).

What each :class:`idemq.TransitionResult` does here (the README explains why):

* APPLIED / ALREADY_APPLIED → return normally: the dedup row commits, the message is acked.
* REJECTED (``ship`` before ``pay``) and NOT_FOUND → raise :class:`RetryLaterError`: the
  transaction rolls back *including the dedup row*, so the redelivery is not mistaken for a
  duplicate; the worker retries it later and dead-letters it after N attempts.
* FENCED → return normally with the verdict: a newer lock holder owns the order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from examples.orders.schema import ORDER_STATES, OrderTables
from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection

from idemq.errors import InvalidMessageError
from idemq.state_machine import StateMachine, TransitionResult

__all__ = [
    "InsufficientFundsError",
    "MessageLike",
    "OrderService",
    "RetryLaterError",
    "handle",
    "order_machine",
]


class MessageLike(Protocol):
    """What a handler reads from an ``idemq.Message``."""

    @property
    def id(self) -> str: ...

    @property
    def delivery_attempt(self) -> int: ...

    def json(self) -> Any: ...


class RetryLaterError(Exception):
    """The message arrived too early (out of order, or its order does not exist yet).

    Raised so the dedup transaction rolls back; the worker should requeue the message with a
    delay and dead-letter it after a few attempts.
    """

    def __init__(self, order_id: str, event: str, verdict: TransitionResult) -> None:
        super().__init__(f"{event!r} on order {order_id!r}: {verdict.value}; retry later")
        self.order_id = order_id
        self.event = event
        self.verdict = verdict


class InsufficientFundsError(Exception):
    """The paying account cannot cover the order: the whole payment rolls back (order stays
    PENDING_PAYMENT), and the message is retried, then dead-lettered."""


def order_machine(tables: OrderTables) -> StateMachine:
    """The order life cycle on ``tables.orders``."""
    return StateMachine(
        tables.orders.name,
        "order_id",
        "status",
        states=ORDER_STATES,
        transitions={
            "pay": (("PENDING_PAYMENT", "PAYMENT_FAILED"), "PAID"),
            "ship": ("PAID", "SHIPPED"),
        },
    )


@dataclass
class OrderService:
    """The business logic for one table prefix; ``handle`` is the worker-facing entry point."""

    prefix: str = ""
    tables: OrderTables = field(init=False)
    machine: StateMachine = field(init=False)

    def __post_init__(self) -> None:
        self.tables = OrderTables.build(self.prefix)
        self.machine = order_machine(self.tables)

    def handle(self, msg: MessageLike, tx: Connection) -> dict[str, Any]:
        """Worker handler ``(msg, tx) -> result``; the result is JSON for duplicate replay."""
        event, order_id = parse_body(msg)
        if event == "pay":
            verdict = self.pay(tx, order_id, msg.id)
        else:
            verdict = self.machine.apply(tx, order_id, event)
        if verdict in (TransitionResult.REJECTED, TransitionResult.NOT_FOUND):
            raise RetryLaterError(order_id, event, verdict)
        return {"order_id": order_id, "event": event, "result": verdict.value}

    def pay(self, tx: Connection, order_id: str, message_id: str) -> TransitionResult:
        """Move the order to PAID and debit its account — the debit only when *this* call
        made the transition, which is what keeps a re-sent payment from charging twice."""
        verdict = self.machine.apply(tx, order_id, "pay", {"paid_by": message_id})
        if verdict is not TransitionResult.APPLIED:
            return verdict
        orders, accounts = self.tables.orders, self.tables.accounts
        account_id, amount = tx.execute(
            select(orders.c.account_id, orders.c.amount).where(orders.c.order_id == order_id)
        ).one()
        debited = tx.execute(
            update(accounts)
            .where(accounts.c.account_id == account_id, accounts.c.balance >= amount)
            .values(balance=accounts.c.balance - amount)
        ).rowcount
        if debited != 1:
            # Raising rolls the transition back with everything else in the transaction.
            raise InsufficientFundsError(f"account {account_id!r} cannot pay {amount} cents")
        tx.execute(
            insert(self.tables.ledger).values(
                order_id=order_id, account_id=account_id, amount=amount, message_id=message_id
            )
        )
        return verdict


def parse_body(msg: MessageLike) -> tuple[str, str]:
    """``(event, order_id)`` from the body; :class:`~idemq.InvalidMessageError` if malformed."""
    body = msg.json()
    if not isinstance(body, dict):
        raise InvalidMessageError(f"message {msg.id!r}: body must be a JSON object")
    event, order_id = body.get("event"), body.get("order_id")
    if event not in ("pay", "ship"):
        raise InvalidMessageError(f"message {msg.id!r}: unknown event {event!r}")
    if not isinstance(order_id, str) or not 0 < len(order_id) <= 64:
        raise InvalidMessageError(f"message {msg.id!r}: order_id must be a 1-64 char string")
    return event, order_id


_DEFAULT = OrderService(prefix=os.environ.get("IDEMQ_ORDERS_PREFIX", ""))


def handle(msg: MessageLike, tx: Connection) -> dict[str, Any]:
    """The module-level handler for ``idemq worker examples.orders.handlers:handle``."""
    return _DEFAULT.handle(msg, tx)
