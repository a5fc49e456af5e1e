"""The order service the chaos runner drives: tables, handlers (dedup + state machine + debit).

Lives in the package so ``idemq chaos`` works once installed; ``examples/orders`` re-exports it.

* ``{prefix}orders``   — order_id, account_id, status, amount (cents), version, fence_token,
  paid_by (id of the message whose ``pay`` moved the order to PAID).
* ``{prefix}accounts`` — account_id, balance and opening_balance (cents), so the invariant
  checker can prove ``balance == opening_balance - debits``.
* ``{prefix}ledger``   — one row per debit, with the message id. Deliberately **no** unique index
  on order_id: a double debit must be *visible* to the invariant checker, not an error.
* ``{prefix}shipments`` — one row per shipment (second hop of ``idemq chaos --two-hop``), with
  the message id; no unique index either, so a double shipment is visible.

A message body is JSON ``{"event": "pay" | "ship", "order_id": "o-1"}``. What each
:class:`idemq.TransitionResult` does in :meth:`OrderService.handle`:

* APPLIED / ALREADY_APPLIED → return normally: the dedup row commits, the message is acked.
* REJECTED (``ship`` before ``pay``) and NOT_FOUND → raise :class:`RetryLaterError`: the
  transaction rolls back *including the dedup row*, so the redelivery is not mistaken for a
  duplicate; the worker retries it later and dead-letters it after N attempts.

:meth:`OrderService.pay_unconditionally` is the seed's consumer — debit with no state check —
which the chaos runner uses to prove what the dedup guard alone prevents.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from idemq.business.state_machine import StateMachine, TransitionResult
from idemq.drivers.sql import async_engine_from_url, engine_from_url
from idemq.errors import InvalidMessageError

__all__ = [
    "ORDER_STATES",
    "InsufficientFundsError",
    "MessageLike",
    "OrderService",
    "OrderTables",
    "RetryLaterError",
    "create_schema",
    "drop_schema",
    "make_async_engine",
    "make_engine",
    "order_machine",
    "parse_body",
    "seed",
]

#: The happy path, in order: "at or past PAID" means PAID or SHIPPED.
ORDER_STATES = ("PENDING_PAYMENT", "PAYMENT_FAILED", "PAID", "SHIPPED")


@dataclass(frozen=True)
class OrderTables:
    """The three tables of one order-service instance (one ``prefix``)."""

    prefix: str
    metadata: MetaData
    orders: Table
    accounts: Table
    ledger: Table
    shipments: Table

    @classmethod
    def build(cls, prefix: str = "") -> OrderTables:
        """Describe the tables for ``prefix`` (nothing is created yet)."""
        md = MetaData()
        orders = Table(
            f"{prefix}orders",
            md,
            Column("order_id", String(64), primary_key=True),
            Column("account_id", String(64), nullable=False),
            Column("status", String(32), nullable=False, default=ORDER_STATES[0]),
            Column("amount", BigInteger, nullable=False),
            Column("version", Integer, nullable=False, default=0),
            Column("fence_token", BigInteger, nullable=True),
            Column("paid_by", String(128), nullable=True),
        )
        accounts = Table(
            f"{prefix}accounts",
            md,
            Column("account_id", String(64), primary_key=True),
            Column("balance", BigInteger, nullable=False),
            Column("opening_balance", BigInteger, nullable=False),
        )
        ledger = Table(
            f"{prefix}ledger",
            md,
            Column("entry_id", Integer, primary_key=True, autoincrement=True),
            Column("order_id", String(64), nullable=False, index=True),
            Column("account_id", String(64), nullable=False),
            Column("amount", BigInteger, nullable=False),
            Column("message_id", String(128), nullable=False),
        )
        shipments = Table(
            f"{prefix}shipments",
            md,
            Column("entry_id", Integer, primary_key=True, autoincrement=True),
            Column("order_id", String(64), nullable=False, index=True),
            Column("message_id", String(128), nullable=False),
        )
        return cls(prefix, md, orders, accounts, ledger, shipments)

    @property
    def names(self) -> list[str]:
        """Table names, for a state machine or a cleanup."""
        return [self.orders.name, self.accounts.name, self.ledger.name, self.shipments.name]


def create_schema(engine: Engine, tables: OrderTables) -> None:
    """Create the tables if they do not exist (safe to call twice)."""
    tables.metadata.create_all(engine)


def drop_schema(engine: Engine, tables: OrderTables) -> None:
    """Drop the tables if they exist."""
    tables.metadata.drop_all(engine)


def seed(
    conn: Connection,
    tables: OrderTables,
    accounts: dict[str, int],
    orders: Iterable[tuple[str, str, int]],
) -> None:
    """Insert ``accounts`` (id → opening balance) and ``orders`` ((order_id, account_id, amount)),
    all PENDING_PAYMENT at version 0."""
    if accounts:
        conn.execute(
            insert(tables.accounts),
            [
                {"account_id": a, "balance": cents, "opening_balance": cents}
                for a, cents in accounts.items()
            ],
        )
    rows: list[dict[str, Any]] = [
        {"order_id": o, "account_id": a, "amount": cents, "status": ORDER_STATES[0], "version": 0}
        for o, a, cents in orders
    ]
    if rows:
        conn.execute(insert(tables.orders), rows)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """The order service's engine: built like a store's (:func:`idemq.drivers.sql.engine_from_url`),
    so SQLite's racing writers queue at ``BEGIN IMMEDIATE`` instead of deadlocking."""
    return engine_from_url(url, **kwargs)


def make_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """The async twin of :func:`make_engine`; ``url`` may name a sync driver (its asyncio twin is
    used)."""
    return async_engine_from_url(url, **kwargs)


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

    def pay_unconditionally(self, tx: Connection, order_id: str, message_id: str) -> int:
        """The seed's consumer: mark PAID and debit *without* checking the order's state.

        Every call debits, so a second delivery of the same message debits twice unless the
        dedup guard stops it — which is exactly what ``idemq chaos`` proves (and, with
        ``--no-guard``, disproves). Returns the amount debited (cents).
        """
        orders, accounts = self.tables.orders, self.tables.accounts
        account_id, amount = tx.execute(
            select(orders.c.account_id, orders.c.amount).where(orders.c.order_id == order_id)
        ).one()
        tx.execute(
            update(orders)
            .where(orders.c.order_id == order_id)
            .values(status="PAID", paid_by=message_id)
        )
        tx.execute(
            update(accounts)
            .where(accounts.c.account_id == account_id)
            .values(balance=accounts.c.balance - amount)
        )
        tx.execute(
            insert(self.tables.ledger).values(
                order_id=order_id, account_id=account_id, amount=amount, message_id=message_id
            )
        )
        return int(amount)

    def ship_unconditionally(self, tx: Connection, order_id: str, message_id: str) -> int:
        """The second hop's consumer: mark SHIPPED and record a shipment, no state check.

        Like :meth:`pay_unconditionally`, every call ships, so only the dedup guard keeps a
        second delivery from shipping twice. Returns 1 (one shipment recorded).
        """
        orders = self.tables.orders
        tx.execute(update(orders).where(orders.c.order_id == order_id).values(status="SHIPPED"))
        tx.execute(insert(self.tables.shipments).values(order_id=order_id, message_id=message_id))
        return 1


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
