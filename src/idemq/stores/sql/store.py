"""``SqlStore``: the dedup table on SQLite, PostgreSQL and MariaDB/MySQL.

It runs the plans of :mod:`idemq.stores.sql.plans` through the plumbing of
:mod:`idemq.drivers.sql`; this module owns the store's transactions and primitives, and the
base it shares with its asyncio twin, :class:`~idemq.stores.sql.store_async.AsyncSqlStore`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from types import TracebackType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import Session

from idemq._clock import system_clock_ms
from idemq.drivers.sql import (
    ENGINE_DEFAULTS,
    IdleConnections,
    keep_limit,
    parse_url,
    prepare_sqlite,
    reusable,
    run,
    sync_url,
    translate_errors,
)
from idemq.errors import (
    ConfigurationError,
    LeaseLostError,
)
from idemq.stores.base import DEFAULT_CONSUMER, Claim, ClaimRequest, Key, Record, StoreStats
from idemq.stores.sql.dialects import ops_for
from idemq.stores.sql.plans import Ops
from idemq.stores.sql.schema import DEFAULT_TABLE, build_table, collation_for, ddl

__all__ = ["DEFAULT_URL", "SqlStore", "schema_sql"]

DEFAULT_URL = "sqlite:///idemq.db"


class SqlStoreBase:
    """What the sync and async stores share: URL, table, plans, schema, safe repr."""

    def __init__(
        self,
        url: URL,
        table: str,
        schema: str | None,
        dialect: sa.Dialect,
        mysql_flavor: str | None,
    ) -> None:
        if not table.replace("_", "").isalnum():
            raise ConfigurationError(f"table name must be letters, digits and '_': {table!r}")
        self.table = build_table(table, schema=schema)
        self.url = url
        self._dialect = dialect
        self._mysql_flavor = mysql_flavor
        self._ops: Ops | None = None
        self.where = f"{url.render_as_string(hide_password=True)} table {table}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where!r})"

    def _ops_for(self, dialect: sa.Dialect) -> Ops:
        # Built on first use: MariaDB vs MySQL is only known once a connection saw the server.
        if self._ops is None:
            quoted = dialect.identifier_preparer.format_table(self.table)
            self._ops = ops_for(
                dialect,
                quoted,
                mysql_flavor=self._mysql_flavor,
                name=self.table.name,
                schema=self.table.schema,
            )
        return self._ops

    def _ddl_table(self, dialect: sa.Dialect) -> sa.Table:
        return build_table(
            self.table.name, schema=self.table.schema, mysql_collation=collation_for(dialect)
        )


class SqlStore(SqlStoreBase):
    """The dedup table in a SQL database, for ``Idempotency`` in transactional or lease mode.

    ``url``: an SQLAlchemy URL (``sqlite:///idemq.db``, ``postgresql+psycopg://…``,
    ``mysql+pymysql://…``) or an existing :class:`~sqlalchemy.engine.Engine`.
    """

    def __init__(
        self,
        url: str | URL | Engine = DEFAULT_URL,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        mysql_flavor: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if isinstance(url, Engine):
            self.engine = url
        else:
            parsed = sync_url(parse_url(url))
            try:
                self.engine = sa.create_engine(parsed, **{**ENGINE_DEFAULTS, **engine_kwargs})
            except (ArgumentError, NoSuchModuleError, ImportError) as exc:
                raise ConfigurationError(f"cannot use {parsed.drivername!r}: {exc}") from exc
            if self.engine.dialect.name == "sqlite":
                prepare_sqlite(self.engine)
        super().__init__(self.engine.url, table, schema, self.engine.dialect, mysql_flavor)
        self._idle: IdleConnections[Connection] = IdleConnections(keep_limit(self.engine.pool))

    # -- schema ------------------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the dedup table and its index if missing (safe to call twice)."""
        with translate_errors("create_schema", self.where), self.engine.begin() as conn:
            self._ddl_table(conn.dialect).create(conn, checkfirst=True)

    def drop_schema(self) -> None:
        """Drop the dedup table (tests, teardown)."""
        with translate_errors("drop_schema", self.where), self.engine.begin() as conn:
            self.table.drop(conn, checkfirst=True)

    # -- plumbing ----------------------------------------------------------------------------

    def _exec(self, conn: Connection, plan: str, *args: Any, what: str) -> Any:
        """Run the plan ``Ops.<plan>(*args)`` of this dialect on ``conn``."""
        with translate_errors(what, self.where):
            return run(conn, getattr(self._ops_for(conn.dialect), plan)(*args))

    def _short(self, plan: str, *args: Any, what: str) -> Any:
        """One primitive in its own short transaction (lease mode and inspection)."""
        with translate_errors(what, self.where), self.transaction() as conn:
            return run(conn, getattr(self._ops_for(conn.dialect), plan)(*args))

    def transaction(self, connection: Any = None) -> AbstractContextManager[Connection]:
        """A transaction for the claim and the business writes.

        With ``connection`` (a ``Connection`` or ORM ``Session`` of yours): inside your open
        transaction a SAVEPOINT (you commit); otherwise a transaction on it that commits here.
        """
        if connection is not None:
            return self._join(connection)
        return _OwnTransaction(self)

    def _checkout(self) -> Connection:
        conn = self._idle.take()
        if conn is None:
            with translate_errors("connect", self.where):
                conn = self.engine.connect()
        return conn

    def _checkin(self, conn: Connection, *, clean: bool) -> None:
        """Keep ``conn`` for the next transaction if it is as idemq found it, else close it."""
        if clean and reusable(conn, self.engine) and self._idle.keep(conn):
            return
        invalidated = conn.invalidated
        conn.close()
        if invalidated:  # a disconnect: the kept ones are likely dead too
            for idle in self._idle.drain():
                idle.close()

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
        with translate_errors("savepoint", self.where):
            return tx.begin_nested()

    def end_savepoint(self, savepoint: Any, *, commit: bool) -> None:
        """Release ``savepoint`` (``commit``) or roll its writes back.

        A rollback that fails means the transaction itself is gone (InnoDB rolls a whole
        transaction back on a deadlock, taking its savepoints with it): the error goes on, so
        the batch fails whole instead of carrying on in a transaction that no longer exists.
        """
        with translate_errors(
            "release savepoint" if commit else "rollback to savepoint", self.where
        ):
            if commit:
                savepoint.commit()
            else:
                savepoint.rollback()

    # -- transactional primitives ------------------------------------------------------------

    def claim_in(self, tx: Connection, request: ClaimRequest) -> Claim:
        return self._exec(tx, "claim", request, True, what="claim")  # type: ignore[no-any-return]

    def claim_many_in(self, tx: Connection, requests: Sequence[ClaimRequest]) -> list[Claim]:
        return self._exec(tx, "claim_many", requests, True, what="claim_many")  # type: ignore[no-any-return]

    def save_result_in(self, tx: Connection, key: Key, result: str) -> None:
        self._exec(tx, "save_result", key, result, what="save_result")

    def release_in(self, tx: Connection, key: Key, owner: str) -> None:
        self._exec(tx, "release_in", key, owner, what="release")

    # -- lease primitives --------------------------------------------------------------------

    def claim(self, request: ClaimRequest) -> Claim:
        return self._short("claim", request, False, what="claim")  # type: ignore[no-any-return]

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        return self._short("claim_many", requests, False, what="claim_many")  # type: ignore[no-any-return]

    def complete(self, key: Key, owner: str, result: str, now_ms: int) -> None:
        if not self._short("complete", key, owner, result, now_ms, what="complete"):
            raise LeaseLostError(
                f"lease on {key.message_id!r} ({key.consumer}) was lost before complete"
            )

    def release(self, key: Key, owner: str) -> None:
        self._short("release", key, owner, what="release")

    # -- inspection and retention ------------------------------------------------------------

    def get(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> Record | None:
        return self._short("get", Key(consumer, message_id), what="get")  # type: ignore[no-any-return]

    def find(self, message_id: str) -> list[Record]:
        return self._short("find", message_id, what="find")  # type: ignore[no-any-return]

    def in_progress(self, *, limit: int = 100) -> list[Record]:
        return self._short("in_progress", limit, what="in_progress")  # type: ignore[no-any-return]

    def purge(
        self, older_than: timedelta, *, batch_size: int = 1000, now_ms: int | None = None
    ) -> int:
        """Delete PROCESSED rows older than ``older_than``, ``batch_size`` per transaction, so
        no long lock is held; returns how many were deleted."""
        cutoff = (now_ms if now_ms is not None else system_clock_ms()) - int(
            older_than.total_seconds() * 1000
        )
        total = 0
        while True:
            deleted: int = self._short("purge_batch", cutoff, batch_size, what="purge")
            total += deleted
            if deleted < batch_size:
                return total

    def stats(self, *, now_ms: int | None = None) -> StoreStats:
        """See :meth:`idemq.stores.base.Store.stats` (one table scan plus a size lookup)."""
        now = system_clock_ms() if now_ms is None else now_ms
        return self._short("stats", now, what="stats")  # type: ignore[no-any-return]

    def force_release(self, message_id: str, consumer: str = DEFAULT_CONSUMER) -> bool:
        """See :meth:`idemq.stores.base.Store.force_release`."""
        key = Key(consumer, message_id)
        return self._short("force_release", key, what="force_release")  # type: ignore[no-any-return]

    def close(self) -> None:
        for conn in self._idle.drain():
            conn.close()
        self.engine.dispose()


class _OwnTransaction:
    """:meth:`SqlStore.transaction` on a connection of the store's own: a kept connection (or a
    new one), BEGIN, then COMMIT — or ROLLBACK when the block raised, which then propagates.

    A class rather than ``@contextmanager``: it runs once per message, and a generator-based
    context manager costs several times as much to enter and leave.
    """

    __slots__ = ("_conn", "_store", "_trans")

    def __init__(self, store: SqlStore) -> None:
        self._store = store

    def __enter__(self) -> Connection:
        store = self._store
        conn = store._checkout()
        with translate_errors("begin", store.where):
            try:
                self._trans = conn.begin()
            except BaseException:
                store._checkin(conn, clean=False)
                raise
        self._conn = conn
        return conn

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        store = self._store
        clean = False
        try:
            if exc is None:
                with translate_errors("commit", store.where):
                    self._trans.commit()
            else:
                with translate_errors("rollback", store.where):
                    self._trans.rollback()
            clean = True
        finally:
            store._checkin(self._conn, clean=clean)


def schema_sql(dialect: str, *, table: str = DEFAULT_TABLE) -> str:
    """The DDL of the dedup table for ``dialect`` (postgresql, mysql, mariadb, sqlite)."""
    names = {"postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mariadb"}
    if dialect not in names:
        raise ConfigurationError(f"dialect must be one of {sorted(names)}, got {dialect!r}")
    target = make_url(f"{names[dialect]}://").get_dialect()()
    return ddl(target, build_table(table, mysql_collation=collation_for(target)))
