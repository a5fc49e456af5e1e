"""Tables of the order service, created with SQLAlchemy Core on SQLite, PostgreSQL or MariaDB.

* ``{prefix}orders``   — order_id, account_id, status, amount (cents), version, fence_token,
  paid_by (id of the message whose ``pay`` moved the order to PAID).
* ``{prefix}accounts`` — account_id, balance and opening_balance (cents), so the invariant
  checker can prove ``balance == opening_balance - debits``.
* ``{prefix}ledger``   — one row per debit. Deliberately **no** unique index on order_id: a
  double debit must be *visible* to the invariant checker, not turned into an error.

``prefix`` lets tests and chaos runs share one database without touching each other's rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    insert,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

__all__ = [
    "ORDER_STATES",
    "OrderTables",
    "async_url",
    "create_schema",
    "drop_schema",
    "make_async_engine",
    "make_engine",
    "seed",
]

#: The happy path, in order: "at or past PAID" means PAID or SHIPPED.
ORDER_STATES = ("PENDING_PAYMENT", "PAYMENT_FAILED", "PAID", "SHIPPED")

# SQLite waits this long for a competing writer before "database is locked".
SQLITE_BUSY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class OrderTables:
    """The three tables of one order-service instance (one ``prefix``)."""

    prefix: str
    metadata: MetaData
    orders: Table
    accounts: Table
    ledger: Table

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
        return cls(prefix, md, orders, accounts, ledger)

    @property
    def names(self) -> list[str]:
        """Table names, for a state machine or a cleanup."""
        return [self.orders.name, self.accounts.name, self.ledger.name]


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
    """``create_engine`` with racing-writer settings for SQLite; other URLs are passed through.

    SQLite's default deferred transactions take the write lock only at the first write, so two
    transactions that both read first can deadlock (one gets SQLITE_BUSY at once, whatever the
    busy timeout). ``BEGIN IMMEDIATE`` takes the write lock up front, so racing writers queue
    behind the busy timeout instead (SQLAlchemy's documented pysqlite recipe).
    """
    if not url.startswith("sqlite"):
        return create_engine(url, **kwargs)
    connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S, **kwargs.pop("connect_args", {})}
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    _begin_immediate(engine)
    return engine


def make_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """The async twin of :func:`make_engine`; ``url`` may be sync-style (see :func:`async_url`)."""
    url = async_url(url)
    if not url.startswith("sqlite"):
        return create_async_engine(url, **kwargs)
    connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S, **kwargs.pop("connect_args", {})}
    engine = create_async_engine(url, connect_args=connect_args, **kwargs)
    _begin_immediate(engine.sync_engine)
    return engine


def async_url(url: str) -> str:
    """Map a sync SQLAlchemy URL to its async driver: aiosqlite, psycopg (async), asyncmy."""
    for sync, asynchronous in (
        ("sqlite+pysqlite://", "sqlite+aiosqlite://"),
        ("sqlite://", "sqlite+aiosqlite://"),
        ("mysql+pymysql://", "mysql+asyncmy://"),
        ("mysql://", "mysql+asyncmy://"),
        ("postgresql://", "postgresql+psycopg://"),
    ):
        if url.startswith(sync):
            return asynchronous + url[len(sync) :]
    return url  # already async (postgresql+psycopg works with create_async_engine)


def _begin_immediate(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_conn: Any, _record: Any) -> None:
        # Stop the driver from issuing its own deferred BEGIN; we emit ours below.
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
