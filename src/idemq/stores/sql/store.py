"""``SqlStore``: the dedup table on SQLite, PostgreSQL and MariaDB/MySQL.

The store's primitives are the plans of :mod:`idemq.stores.sql.dialects`, carried out through
:mod:`idemq.drivers.sql`; this module owns which transaction each runs in: the caller's
(``*_in`` primitives, inside the business transaction) or one of the store's own (lease
primitives, inspection, and the business transaction when the caller brings no connection),
begun on SQLAlchemy's pool by :class:`~idemq.drivers.sql.Transactions`, which keeps the last
one's connection for the next. It also holds the base
shared with the asyncio twin, :class:`~idemq.stores.sql.store_async.AsyncSqlStore`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from idemq._backoff import Backoff
from idemq._clock import system_clock_ms
from idemq.drivers.sql import (
    Plan,
    Transactions,
    driver_reports_aborts,
    engine_from_url,
    run,
    transaction_lost_reason,
    translate_db_error,
    translated,
)
from idemq.errors import (
    ConfigurationError,
    StoreConflictError,
    StoreError,
    StoreUnavailableError,
    TransactionLostError,
)
from idemq.stores.base import (
    DEFAULT_CONSUMER,
    LEASE_CLOCKS,
    STORED_NONE,
    Claim,
    ClaimRequest,
    ForgetResult,
    Key,
    Record,
    StoreStats,
    expiry_ms,
)
from idemq.stores.sql.dialects import plans_for
from idemq.stores.sql.plans import PlanOptions, SqlPlans
from idemq.stores.sql.schema import (
    DEFAULT_TABLE,
    SCHEMA_VERSION,
    build_table,
    collation_for,
    ddl,
)
from idemq.stores.sql.versions import create_recorded, forget_version, plan_upgrade

__all__ = [
    "CONFLICT_PAUSE_S",
    "DEFAULT_URL",
    "OWN_TRANSACTION_ATTEMPTS",
    "SqlStore",
    "SqlStoreAdmin",
    "SqlStoreBase",
    "schema_sql",
]

DEFAULT_URL = "sqlite:///idemq.db"

log = logging.getLogger("idemq.store")

T = TypeVar("T")

OWN_TRANSACTION_ATTEMPTS = 6
"""How often a store's own transaction runs when the server keeps rolling it back (deadlocks)."""

CONFLICT_PAUSE_S = 0.01
"""The first window of the random pause before a store's own transaction runs again after a
conflict; it doubles at each further conflict (see :meth:`SqlStoreBase.conflict_pause_s`)."""

# Full jitter: racers that deadlocked one another must not run again in lock-step.
_CONFLICT_BACKOFF = Backoff(CONFLICT_PAUSE_S, 1.0, jitter=1.0)

#: A primitive, given the store's plans: ``lambda plans: plans.get(key)``.
Primitive = Callable[[SqlPlans], Plan[T]]


def resolve_lease_clock(url: URL, lease_clock: str | None) -> str:
    """``lease_clock`` checked against the database of ``url``: ``"store"`` (the default on
    PostgreSQL, MariaDB and MySQL) judges leases on the database server's clock, ``"client"``
    (SQLite's only choice: it runs in this process) on the guard's."""
    on_server = url.get_backend_name() != "sqlite"
    if lease_clock is None:
        return "store" if on_server else "client"
    if lease_clock not in LEASE_CLOCKS:
        raise ConfigurationError(
            f"lease_clock must be one of {', '.join(map(repr, LEASE_CLOCKS))}, got {lease_clock!r}"
        )
    if lease_clock == "store" and not on_server:
        raise ConfigurationError(
            "lease_clock='store' needs a database server's clock; SQLite runs in this process, "
            "so its leases use the guard's clock (lease_clock='client')"
        )
    return lease_clock


class SqlStoreBase:
    """What the sync and async stores share: URL, table, plans, schema, safe repr."""

    def __init__(
        self,
        url: URL,
        table: str,
        *,
        schema: str | None,
        mysql_flavor: str | None,
        lease_clock: str | None,
        expires_after_s: float | None,
    ) -> None:
        self.table = build_table(table, schema=schema)
        self.url = url
        self._mysql_flavor = mysql_flavor
        self.lease_clock = resolve_lease_clock(url, lease_clock)
        self.expires_after_ms = expiry_ms(expires_after_s)
        self._plans: SqlPlans | None = None
        self.where = f"{url.render_as_string(hide_password=True)} table {table}"
        self._jitter = random.Random()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where!r})"

    def _plans_for(self, dialect: sa.Dialect) -> SqlPlans:
        # Built on first use: MariaDB vs MySQL is only known once a connection saw the server.
        if self._plans is None:
            self._plans = plans_for(
                dialect,
                self.table,
                mysql_flavor=self._mysql_flavor,
                options=PlanOptions(
                    store_clock=self.lease_clock == "store", expires_after_ms=self.expires_after_ms
                ),
            )
        return self._plans

    def ddl_table(self, dialect: sa.Dialect) -> sa.Table:
        """The table as it is created on ``dialect`` (MySQL's and MariaDB's key collations
        differ; a connected dialect knows which server it is)."""
        return build_table(
            self.table.name, schema=self.table.schema, mysql_collation=collation_for(dialect)
        )

    def _create_recorded(self, conn: Connection) -> None:
        table = self.ddl_table(conn.dialect)
        if create_recorded(conn, table, "dedup", SCHEMA_VERSION):
            return
        try:
            found = plan_upgrade(conn, table, "dedup", SCHEMA_VERSION).found
        except ConfigurationError as exc:  # used as it is, as before; its claims will say more
            log.warning("%s", exc)
            return
        if found < SCHEMA_VERSION:
            log.warning(
                "table %s is at schema version %d (this idemq's is %d): it works as it is; "
                "`idemq schema upgrade --store URL --table %s` brings it up in place",
                table.name,
                found,
                SCHEMA_VERSION,
                table.name,
            )

    def _drop_recorded(self, conn: Connection) -> None:
        self.table.drop(conn, checkfirst=True)
        forget_version(conn, self.table.name, self.table.schema)

    def transaction_lost_by(self, error: BaseException) -> StoreError | None:
        """The store error a handler's own failed statement stands for when the transaction it
        ran in is gone — a deadlock, serialization failure or lock timeout (the server rolled it
        back: :class:`~idemq.StoreConflictError`) or a dropped connection
        (:class:`~idemq.StoreUnavailableError`) — else None: the handler's own error."""
        if not isinstance(error, DBAPIError):
            return None
        lost = translate_db_error(error, f"a handler's statement on {self.where}")
        return lost if isinstance(lost, StoreConflictError | StoreUnavailableError) else None

    def conflict_pause_s(self, conflicts: int) -> float:
        """How long to wait before a store's own transaction runs again after its
        ``conflicts``-th deadlock: a random share of a window that doubles each time.

        Racers that deadlocked one another (lease claims of one message, on MySQL's portable
        plan: each holds a shared lock from INSERT IGNORE and wants it exclusive for the
        takeover or the expired record's delete) would otherwise run again in lock-step and
        meet in the same deadlock, until one ran out of attempts.
        """
        return _CONFLICT_BACKOFF.delay_s(conflicts, self._jitter.random)

    def _confirm_plan(
        self, driver_connection: Any, key: Key, owner: str, result: str, *, deferred: bool
    ) -> Primitive[None] | None:
        """The first half of ``confirm_in``: raise :class:`~idemq.TransactionLostError` if the
        driver already says the transaction is gone (``driver_connection``: psycopg's, else
        None), then the statement still needed, if any.

        On psycopg the status is complete: every failed statement aborts a PostgreSQL
        transaction, so one still INTRANS holds every row it wrote, and only a result other
        than None needs its UPDATE. Elsewhere (InnoDB rolls a transaction back on a deadlock
        and the next statement starts a new one; SQLite) only a statement that finds the row
        proves it, unless a batch's single read does so later (``deferred``).
        """
        if driver_connection is not None:
            reason = transaction_lost_reason(driver_connection)
            if reason is not None:
                raise TransactionLostError(
                    f"the transaction of {key.message_id!r} ({key.consumer}) on {self.where} is "
                    f"lost: {reason}; nothing is committed, the message runs again"
                )
            if result == STORED_NONE:
                return None
        elif deferred and result == STORED_NONE:
            return None
        return lambda plans: plans.confirm(key, owner, result)

    def _must_read_rows(self, driver_connection: Any, requests: Sequence[ClaimRequest]) -> bool:
        """``confirm_many_in``: True when a read must prove the rows (no psycopg status)."""
        if driver_connection is None:
            return True
        reason = transaction_lost_reason(driver_connection)
        if reason is not None:
            raise TransactionLostError(
                f"the transaction of a batch of {len(requests)} on {self.where} is lost: "
                f"{reason}; nothing is committed, the batch runs again"
            )
        return False

    @staticmethod
    def _cutoff_ms(older_than: timedelta, now_ms: int | None) -> int:
        now = system_clock_ms() if now_ms is None else now_ms
        return now - int(older_than.total_seconds() * 1000)


class SqlStoreAdmin(SqlStoreBase):
    """The operator's tools (:class:`~idemq.stores.base.StoreAdmin`) and ``forget`` of a sync
    SQL store, each in a short transaction of the store's own: written once for
    :class:`SqlStore` and :class:`~idemq.integrations.django.DjangoStore` (which runs them on
    idemq's own connection to Django's database)."""

    def _own_transaction(self, doing: str, primitive: Primitive[T]) -> T:
        """Run ``primitive`` in a short transaction of the store's own (each store says on
        which connection)."""
        raise NotImplementedError

    def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        """The record of ``message_id`` for ``consumer``, or None."""
        key = Key(consumer, message_id)
        return self._own_transaction("get", lambda plans: plans.get(key))

    def find(self, message_id: str) -> list[Record]:
        """Every consumer's record of ``message_id``."""
        return self._own_transaction("find", lambda plans: plans.find(message_id))

    def in_progress(self, *, limit: int = 100) -> list[Record]:
        """PROCESSING records, oldest first."""
        return self._own_transaction("in_progress", lambda plans: plans.in_progress(limit))

    def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        """Delete PROCESSED rows older than ``older_than``, ``batch_size`` per transaction, so
        no long lock is held; returns how many were deleted."""
        cutoff_ms = self._cutoff_ms(older_than, now_ms)
        total = 0
        while True:
            deleted = self._own_transaction(
                "purge", lambda plans: plans.purge_batch(cutoff_ms, batch_size)
            )
            total += deleted
            if deleted < batch_size:
                return total

    def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """See :meth:`idemq.stores.base.StoreAdmin.stats` (one table scan plus a size lookup)."""
        now = system_clock_ms() if now_ms is None else now_ms
        return self._own_transaction("stats", lambda plans: plans.stats(now))

    def forget(
        self,
        message_id: str,
        consumer: str = DEFAULT_CONSUMER,
        *,
        force: bool = False,
        now_ms: int | None = None,
    ) -> ForgetResult:
        """See :meth:`idemq.stores.base.GuardStore.forget`."""
        key = Key(consumer, message_id)
        now = system_clock_ms() if now_ms is None else now_ms
        return self._own_transaction(
            "forget", lambda plans: plans.forget(key, force=force, now_ms=now)
        )

    def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """See :meth:`idemq.stores.base.StoreAdmin.force_release`."""
        key = Key(consumer, message_id)
        return self._own_transaction("force_release", lambda plans: plans.force_release(key))


class SqlStore(SqlStoreAdmin):
    """The dedup table in a SQL database, for ``Idempotency`` in transactional or lease mode.

    ``url``: an SQLAlchemy URL (``sqlite:///idemq.db``, ``postgresql+psycopg://…``,
    ``mysql+pymysql://…``) or an existing :class:`~sqlalchemy.engine.Engine`; ``engine_kwargs``
    go to :func:`~sqlalchemy.create_engine` (``pool_size``, ``pool_timeout`` …).

    ``lease_clock``: whose clock sets and judges leases. ``"store"`` (the default on
    PostgreSQL, MariaDB and MySQL): the database server's, so workers whose clocks disagree
    still agree on whether a lease is live; the guard's ``now_ms`` then only stamps nothing a
    lease depends on, and ``stats``/``forget`` judge at the server's now (``now_ms`` is
    ignored). ``"client"``: the guard's injected clock (SQLite's only choice; tests that move
    time with a fake clock).

    ``expires_after_s``: how long a completed record answers DUPLICATE. A record completed
    longer ago (by the guard's clock, against its stored ``processed_time``) counts as absent:
    the next delivery of its message deletes it in the claim's transaction and runs again.
    None (the default): records never expire; ``purge`` removes old ones.
    """

    def __init__(
        self,
        url: str | URL | Engine = DEFAULT_URL,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        mysql_flavor: str | None = None,
        lease_clock: str | None = None,
        expires_after_s: float | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.engine = url if isinstance(url, Engine) else engine_from_url(url, **engine_kwargs)
        self._transactions = Transactions(self.engine)
        super().__init__(
            self.engine.url,
            table,
            schema=schema,
            mysql_flavor=mysql_flavor,
            lease_clock=lease_clock,
            expires_after_s=expires_after_s,
        )

    # -- schema ------------------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the dedup table and its indexes if missing, recording its schema version
        (safe to call twice; a table that exists is used as it is: ``idemq schema upgrade``
        brings an older one up)."""
        with translated(f"create_schema on {self.where}"), self.engine.begin() as conn:
            self._create_recorded(conn)

    def drop_schema(self) -> None:
        """Drop the dedup table (tests, teardown)."""
        with translated(f"drop_schema on {self.where}"), self.engine.begin() as conn:
            self._drop_recorded(conn)

    # -- transactions ------------------------------------------------------------------------

    def transaction(self, connection: Any = None) -> AbstractContextManager[Connection]:
        """A transaction for the claim and the business writes.

        With ``connection`` (a ``Connection`` or ORM ``Session`` of yours): inside your open
        transaction a SAVEPOINT (you commit); otherwise a transaction on it that commits here.
        Without: ``engine.begin()``, committed when the block ends, rolled back when it raises.
        """
        if connection is not None:
            return self._join(connection)
        return self._transactions.begin(self.where)

    @contextmanager
    def _join(self, connection: Any) -> Iterator[Connection]:
        if isinstance(connection, Session):
            with connection.begin_nested():
                yield connection.connection()
        elif isinstance(connection, Connection):
            ctx = connection.begin_nested() if connection.in_transaction() else connection.begin()
            with ctx:
                yield connection
        else:
            raise ConfigurationError(
                f"connection must be an SQLAlchemy Connection or Session, got {type(connection)}"
            )

    def begin_savepoint(self, tx: Connection) -> Any:
        """A SAVEPOINT inside ``tx`` for one batch message's writes; end it with
        :meth:`end_savepoint`."""
        with translated(f"savepoint on {self.where}"):
            return tx.begin_nested()

    def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        """Release ``savepoint`` (``commit``) or roll its writes back.

        A rollback that fails means the transaction itself is gone (InnoDB rolls a whole
        transaction back on a deadlock, taking its savepoints with it): the error goes on, so
        the batch fails whole instead of carrying on in a transaction that no longer exists.
        """
        doing = "release savepoint" if commit else "rollback to savepoint"
        with translated(f"{doing} on {self.where}"):
            if commit:
                savepoint.commit()
            else:
                savepoint.rollback()

    def translate_handler_error(self, tx: Connection, error: BaseException) -> StoreError | None:
        """See :meth:`SqlStoreBase.transaction_lost_by`."""
        return self.transaction_lost_by(error)

    def _in_transaction(self, tx: Connection, doing: str, primitive: Primitive[T]) -> T:
        """Run ``primitive`` inside ``tx``, the caller's open transaction."""
        return run(tx, primitive(self._plans_for(tx.dialect)), f"{doing} on {self.where}")

    def _own_transaction(self, doing: str, primitive: Primitive[T]) -> T:
        """Run ``primitive`` in a short transaction of the store's own, and again (up to
        :data:`OWN_TRANSACTION_ATTEMPTS` times, after :meth:`conflict_pause_s`) when it ends in
        a :class:`~idemq.StoreConflictError`: the transaction was rolled back whole, so nothing
        of it is left to redo. Two lease claims that both read a record under a shared lock and
        then change it (MySQL's portable plan, an expired record's delete) deadlock; the loser
        runs again and finds the winner's claim."""
        attempt = 1
        while True:
            try:
                with self._transactions.begin(self.where) as conn:
                    return self._in_transaction(conn, doing, primitive)
            except StoreConflictError:
                if attempt >= OWN_TRANSACTION_ATTEMPTS:
                    raise
                time.sleep(self.conflict_pause_s(attempt))
                attempt += 1

    # -- transactional primitives ------------------------------------------------------------

    def claim_in(self, tx: Connection, request: ClaimRequest) -> Claim:
        """Claim inside ``tx``, the business transaction (the row is written PROCESSED)."""
        return self._in_transaction(tx, "claim", lambda plans: plans.claim_unexpired(request, True))

    def claim_many_in(self, tx: Connection, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch inside ``tx``: one multi-row insert, one read."""
        return self._in_transaction(
            tx, "claim_many", lambda plans: plans.claim_many(requests, True)
        )

    def confirm_in(
        self, tx: Connection, key: Key, owner: str, result: str, *, deferred: bool = False
    ) -> None:
        """See :meth:`idemq.stores.base.TransactionalGuardStore.confirm_in`."""
        primitive = self._confirm_plan(
            self._driver_connection(tx), key, owner, result, deferred=deferred
        )
        if primitive is not None:
            self._in_transaction(tx, "confirm", primitive)

    def confirm_many_in(self, tx: Connection, requests: Sequence[ClaimRequest]) -> None:
        """See :meth:`idemq.stores.base.TransactionalGuardStore.confirm_many_in`."""
        if requests and self._must_read_rows(self._driver_connection(tx), requests):
            keys = [r.key for r in requests]
            owners = [r.owner for r in requests]
            self._in_transaction(tx, "confirm", lambda plans: plans.confirm_many(keys, owners))

    def _driver_connection(self, tx: Connection) -> Any:
        """psycopg's connection under ``tx`` when it reports aborted transactions, else None."""
        if not driver_reports_aborts(tx.dialect):
            return None
        with translated(f"confirm on {self.where}"):
            return tx.connection.driver_connection

    def release_in(self, tx: Connection, key: Key, owner: str) -> None:
        """Undo a batch claim of ``owner`` inside ``tx``."""
        self._in_transaction(tx, "release", lambda plans: plans.release_in(key, owner))

    # -- lease primitives --------------------------------------------------------------------

    def claim(self, request: ClaimRequest) -> Claim:
        """Claim in lease mode, in a short transaction of the store's own."""
        return self._own_transaction("claim", lambda plans: plans.claim_unexpired(request, False))

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch in lease mode (one transaction)."""
        return self._own_transaction("claim_many", lambda plans: plans.claim_many(requests, False))

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        """Mark PROCESSED; :class:`~idemq.LeaseLostError` if ``owner`` lost the lease."""
        self._own_transaction("complete", lambda plans: plans.complete(key, owner, result, now_ms))

    def release(self, key: Key, owner: str) -> None:
        """Delete the PROCESSING record if ``owner`` still holds it."""
        self._own_transaction("release", lambda plans: plans.release(key, owner))

    def renew(self, key: Key, owner: str, lease_until_ms: int, now_ms: int) -> bool:
        """See :meth:`idemq.stores.base.GuardStore.renew`."""
        return self._own_transaction(
            "renew", lambda plans: plans.renew(key, owner, lease_until_ms, now_ms)
        )

    def close(self) -> None:
        """Close every pooled connection (the engine is disposed)."""
        self._transactions.close()
        self.engine.dispose()


def schema_sql(dialect: str, *, table: str = DEFAULT_TABLE) -> str:
    """The DDL of the dedup table for ``dialect`` (postgresql, mysql, mariadb, sqlite)."""
    names = {"postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mariadb"}
    if dialect not in names:
        raise ConfigurationError(f"dialect must be one of {sorted(names)}, got {dialect!r}")
    target = make_url(f"{names[dialect]}://").get_dialect()()
    return ddl(target, build_table(table, mysql_collation=collation_for(target)))
