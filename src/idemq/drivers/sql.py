"""The connection plumbing of the SQL stores: engines, kept connections, errors, running plans.

:mod:`idemq.stores.sql` holds the two stores; this module holds what they share below them:

* URL → engine defaults (the drivers idemq is tested with; SQLite's WAL and ``BEGIN IMMEDIATE``);
* the connections a store keeps checked out between its transactions (:class:`IdleConnections`);
* the translation of driver errors into the idemq tree (:class:`translate_errors`);
* running the I/O-free plans of :mod:`idemq.stores.sql.plans` (:func:`run`, :func:`arun`).

Kept connections: checking a connection out of SQLAlchemy's pool and back in costs ~20 µs of CPU
per transaction (pool bookkeeping, the ``Connection`` object, the return to the queue): on SQLite
more than the claim itself, on PostgreSQL and MariaDB several percent of a message. A store
therefore keeps the ``Connection`` of a transaction that ended cleanly for its next one, and never
holds more than the pool would keep open anyway:

* only with a ``QueuePool`` and at most its ``pool_size`` — a ``NullPool`` (e.g. behind
  PgBouncer) or a ``StaticPool`` is used as configured, and overflow connections still close;
* not when the pool checks connections on checkout (``pool_pre_ping``, ``pool_recycle``): those
  checks would be skipped for a kept connection;
* only a connection whose transaction committed or rolled back without error and that the handler
  left as it found it (not closed, not invalidated, no transaction open, no execution options);
* a disconnect seen on any connection drops them all (the database probably restarted; the pool
  replaces them on its next checkout);
* after ``os.fork()`` the child never uses the parent's connections (their sockets are shared).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.pool import Pool, QueuePool

from idemq.errors import ConfigurationError, StoreConflictError, StoreError, StoreUnavailableError

__all__ = [
    "ENGINE_DEFAULTS",
    "IdleConnections",
    "arun",
    "async_url",
    "keep_limit",
    "parse_url",
    "prepare_sqlite",
    "reusable",
    "run",
    "sync_url",
    "translate_errors",
]

C = TypeVar("C")

SQLITE_BUSY_TIMEOUT_S = 30.0

# Every transaction idemq opens ends in COMMIT or ROLLBACK, and SQLAlchemy's Connection rolls back
# on close; the pool's extra reset ROLLBACK would be one more round trip per message on PyMySQL.
ENGINE_DEFAULTS: dict[str, Any] = {"pool_reset_on_return": None, "pool_pre_ping": False}


class translate_errors:  # a context manager named like one
    """Driver errors → the idemq tree, cause kept. Messages never include the URL or params.

    ``with translate_errors("claim", store.where):`` — a class rather than ``@contextmanager``
    (a generator per use) and the message built only on error: it wraps every statement.
    """

    __slots__ = ("what", "where")

    def __init__(self, what: str, where: str) -> None:
        self.what = what
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        where = f"{self.what} on {self.where}"
        if isinstance(exc, DBAPIError):
            raise translate_db_error(exc, where) from exc
        if isinstance(exc, SQLAlchemyError):  # pool timeout, closed connection, …
            raise StoreUnavailableError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if isinstance(exc, OSError):
            raise StoreUnavailableError(f"{where}: {exc}") from exc


def parse_url(url: str | URL) -> URL:
    try:
        return make_url(url)
    except ArgumentError as exc:
        raise ConfigurationError(f"not a database URL: {exc}") from exc


def sync_url(url: URL) -> URL:
    """Bare scheme → the driver idemq is tested with (psycopg 3, PyMySQL)."""
    drivers = {
        "postgresql": "postgresql+psycopg",
        "mysql": "mysql+pymysql",
        "mariadb": "mariadb+pymysql",
    }
    return url.set(drivername=drivers.get(url.drivername, url.drivername))


def async_url(url: URL) -> URL:
    backend = url.get_backend_name()
    drivers = {
        "postgresql": "postgresql+psycopg",
        "mysql": "mysql+asyncmy",
        "mariadb": "mariadb+asyncmy",
        "sqlite": "sqlite+aiosqlite",
    }
    if url.get_driver_name() in ("psycopg", "asyncpg", "asyncmy", "aiomysql", "aiosqlite"):
        return url
    return url.set(drivername=drivers.get(backend, url.drivername))


def prepare_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, and ``BEGIN IMMEDIATE``.

    pysqlite's own transaction handling begins lazily and would let two writers both read, then
    deadlock upgrading to write (``database is locked``). Taking the write lock at BEGIN makes
    racing claims queue behind each other instead; it also makes SAVEPOINT work.

    SQLAlchemy's recipe issues the BEGIN from a ``begin`` engine event, but any connection event
    on an engine turns on event dispatch for every statement run on it (~10 µs each, and ~50 µs
    per transaction for the BEGIN run through ``exec_driver_sql``). The dialect's ``do_begin``
    hook — a no-op for pysqlite — runs at the same moment for every transaction on this engine
    (idemq's, and the caller's own ``engine.begin()``), without it.
    """

    @event.listens_for(engine, "connect")  # a pool event: runs once per new DBAPI connection
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    # This engine's own dialect instance (create_engine builds one per engine).
    engine.dialect.do_begin = _begin_immediate  # type: ignore[method-assign,assignment]


def _begin_immediate(dbapi_conn: Any) -> None:
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("BEGIN IMMEDIATE")
    finally:
        cursor.close()


def reusable(conn: Connection | None, engine: Engine) -> bool:
    """Closed, invalidated, in a transaction, or with execution options of its own (the handler
    set them on ``tx``): not for the next message."""
    return (
        conn is not None
        and not conn.closed
        and not conn.invalidated
        and not conn.in_transaction()
        and conn.get_execution_options() == engine.get_execution_options()
    )


def run(conn: Connection, plan: Plan) -> Any:
    """Run a plan on the DBAPI cursor of ``conn``, inside its current transaction.

    idemq's own statements skip SQLAlchemy's execution and result machinery: on the per-message
    path it cost more CPU than the database round trip (see bench/sql_guard.py). Driver errors
    go through SQLAlchemy's own error handling, so :func:`translate_errors` sees one kind.
    """
    cursor = _cursor(conn)
    sql: str = ""
    params: dict[str, Any] = {}
    try:
        step = next(plan)
        while True:
            sql, params, returns_rows = step
            cursor.execute(sql, params)
            # (Asking the cursor for its description would build column objects: measurable.)
            rows = cursor.fetchall() if returns_rows else []
            step = plan.send(Reply(rows, cursor.rowcount))
    except StopIteration as stop:
        return stop.value
    except BaseException as exc:
        # The next plan on this connection gets a new cursor: SQLAlchemy's handling below closes
        # this one, and one interrupted mid-statement is in no known state.
        conn.connection.info.pop(_CURSOR, None)
        if isinstance(exc, conn.dialect.loaded_dbapi.Error):
            # SQLAlchemy's own handling, as for its own statements: the error wrapped,
            # ``handle_error`` hooks run, and on a disconnect this connection and the pool's
            # older ones invalidated (a restarted server killed them all; each is replaced at
            # its next checkout).
            conn._handle_dbapi_exception(exc, sql, params, cursor, None)
        raise


_CURSOR = "idemq.cursor"


def _cursor(conn: Connection) -> Any:
    """idemq's cursor on the DBAPI connection under ``conn``: one per DBAPI connection, kept in
    the pool's ``info`` for it and reused by every plan — psycopg spends more building a cursor
    than running a duplicate's claim through it. A cursor of another (replaced) DBAPI
    connection is never reused."""
    fairy = conn.connection
    dbapi_conn = fairy.dbapi_connection
    cursor = fairy.info.get(_CURSOR)
    if cursor is None or cursor.connection is not dbapi_conn:
        cursor = fairy.info[_CURSOR] = dbapi_conn.cursor()  # type: ignore[union-attr]
    return cursor


async def arun(conn: AsyncConnection, plan: Plan) -> Any:
    try:
        step = next(plan)
        while True:
            sql, params, _returns_rows = step
            cursor = await conn.exec_driver_sql(sql, params)
            rows = [tuple(r) for r in cursor.fetchall()] if cursor.returns_rows else []
            step = plan.send(Reply(rows, cursor.rowcount))
    except StopIteration as stop:
        return stop.value


def keep_limit(pool: Pool) -> int:
    """How many idle connections a store may keep checked out of ``pool`` (0: none)."""
    if not isinstance(pool, QueuePool):
        return 0
    # Private, but the only place these settings live; a pool that checks each checkout must
    # see every checkout.
    if getattr(pool, "_pre_ping", True) or getattr(pool, "_recycle", 0) >= 0:
        return 0
    return pool.size()


class IdleConnections(Generic[C]):
    """A LIFO of idle connections (the most recently used is the warmest), safe across threads.

    ``list.append``/``list.pop`` are atomic, so no lock is taken on the per-message path; two
    threads racing past the length check can exceed the limit by one each, never unboundedly
    (each holds a connection it was using anyway).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._idle: list[C] = []
        # The parent's connections, kept referenced in a forked child: collecting them would
        # return them to the pool, which may close them — on a socket the parent still uses.
        self._inherited: list[C] = []
        _ALIVE.add(self)

    def take(self) -> C | None:
        """An idle connection, or ``None`` (check one out of the pool)."""
        try:
            return self._idle.pop()
        except IndexError:
            return None

    def keep(self, conn: C) -> bool:
        """Keep ``conn`` for the next transaction; ``False``: the caller closes it."""
        if len(self._idle) >= self.limit:
            return False
        self._idle.append(conn)
        return True

    def drain(self) -> list[C]:
        """Every idle connection, for the caller to close (disconnect seen, store closed)."""
        drained: list[C] = []
        while True:  # pop one by one: a connection kept meanwhile is drained too, never lost
            try:
                drained.append(self._idle.pop())
            except IndexError:
                return drained

    def _forked_copy(self) -> None:
        self._inherited += self._idle
        self._idle = []


# Every IdleConnections alive in this process, so a fork can empty the child's copies (a check of
# os.getpid() per message would cost a system call each time).
_ALIVE: weakref.WeakSet[IdleConnections[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for idle in list(_ALIVE):
        idle._forked_copy()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Reply(NamedTuple):
    """What a plan gets back for one statement (a tuple: built for every statement)."""

    rows: Sequence[tuple[Any, ...]]  # as the driver's fetchall() returns them
    rowcount: int


Step = tuple[str, dict[str, Any], bool]  # (sql, params, returns rows)


Plan = Generator[Step, Reply, Any]


# Server error codes meaning "another transaction got in the way; run the whole thing again".
_PG_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03"})  # serialization, deadlock, lock


_MYSQL_RETRYABLE_ERRNOS = frozenset({1205, 1213})  # lock wait timeout, deadlock


def translate_db_error(error: exc.DBAPIError, doing: str) -> StoreError:
    """Map a SQLAlchemy-wrapped driver error to the idemq error a consumer can act on.

    * deadlock / serialization failure / lock timeout → :class:`StoreConflictError` (roll back and
      run the message again: nothing was committed);
    * lost connection, timeouts, other operational failures → :class:`StoreUnavailableError`;
    * anything else (missing table, constraint violation …) → :class:`StoreError`.

    The caller raises the returned error ``from`` the original, so the driver error stays as
    ``__cause__``.
    """
    orig = error.orig
    sqlstate = getattr(orig, "sqlstate", None)
    args = getattr(orig, "args", ())
    errno = args[0] if args else None
    # First line only: driver messages can run on with the statement and its parameters.
    first_line = (str(orig).strip().splitlines() or [""])[0]
    message = f"{doing} failed: {type(orig).__name__}: {first_line}"
    if sqlstate in _PG_RETRYABLE_SQLSTATES or errno in _MYSQL_RETRYABLE_ERRNOS:
        return StoreConflictError(message)
    if isinstance(error, exc.OperationalError) and "database is locked" in str(orig):
        return StoreConflictError(message)  # SQLite busy timeout ran out
    if error.connection_invalidated or isinstance(error, exc.OperationalError | exc.InterfaceError):
        return StoreUnavailableError(message)
    return StoreError(message)


def sql_engine(engine_or_url: sa.Engine | str) -> sa.Engine:
    """A SQLAlchemy Engine from an Engine (returned as is) or a URL."""
    if isinstance(engine_or_url, sa.Engine):
        return engine_or_url
    try:
        return sa.create_engine(engine_or_url)
    except (SQLAlchemyError, ImportError, ValueError) as exc:
        raise ConfigurationError(f"cannot build a SQL engine from {engine_or_url!r}") from exc
