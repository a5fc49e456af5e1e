"""The SQLAlchemy boundary: engines from URLs, SQLite's write lock at BEGIN, errors, plan steps.

Everything idemq does to a SQL database passes through here, and each piece prevents one failure:

* :func:`engine_from_url` / :func:`async_engine_from_url` pick the drivers idemq is tested with,
  and on the engines idemq builds itself:

  - SQLite transactions take the write lock at ``BEGIN`` (:func:`prepare_sqlite`). pysqlite's
    own transaction handling begins lazily, so two writers could both read, then deadlock
    upgrading to write (``database is locked``); with ``BEGIN IMMEDIATE`` racing claims queue
    behind each other instead;
  - a forked child never uses a connection it inherited from its parent's pool
    (:func:`discard_inherited_connections`): both processes would talk over one socket.

* :func:`translate_db_error` maps SQLAlchemy's errors (it wraps every driver's in
  :class:`~sqlalchemy.exc.DBAPIError`) to the idemq tree, so no psycopg or PyMySQL exception
  reaches a caller and a deadlock is told apart from an outage.
* :meth:`Transactions.begin` / :func:`abegin` are ``engine.begin()`` with those errors
  translated for the connect, ``BEGIN``, ``COMMIT`` and ``ROLLBACK`` only: what the block itself
  raises (a handler's own error) propagates untouched; the sync one keeps the connection of the
  last transaction for the next.
* :func:`run` / :func:`arun` carry out a sans-I/O SQL :data:`Plan` (the stores' primitives, the
  business guards) on a connection, one :class:`Step` at a time: a Core statement through
  ``Connection.execute``, a :class:`DriverStatement` (the statements run for every message,
  compiled once) on the DBAPI cursor of the connection the transaction holds.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque, namedtuple
from collections.abc import (
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql import Executable
from sqlalchemy.sql.compiler import SQLCompiler

from idemq._plan import adrive, drive
from idemq.drivers.extras import SQL_DRIVER_EXTRAS, missing_extra
from idemq.drivers.urls import mask_url
from idemq.errors import (
    ConfigurationError,
    DuplicateKeyError,
    StoreConfigurationError,
    StoreConflictError,
    StoreError,
    StoreIntegrityError,
    StoreUnavailableError,
    TransactionLostError,
)

__all__ = [
    "ENGINE_DEFAULTS",
    "KEEP_IDLE_S",
    "DriverStatement",
    "Plan",
    "Reply",
    "Step",
    "Transactions",
    "abegin",
    "arun",
    "arun_step",
    "async_engine_from_url",
    "async_url",
    "check_sqlite_transaction",
    "connection_lost",
    "create_table_once",
    "discard_inherited_connections",
    "driver_reports_aborts",
    "engine_from_url",
    "parse_url",
    "prepare_sqlite",
    "run",
    "run_step",
    "sql_engine",
    "sync_url",
    "transaction_aborted",
    "transaction_lost_reason",
    "translate_db_error",
    "translated",
]

T = TypeVar("T")

SQLITE_BUSY_TIMEOUT_S = 30.0

# Every transaction a store opens ends in COMMIT or ROLLBACK, and a Connection rolls back whatever
# is left open when it closes, so the pool's own reset ROLLBACK on check-in would only add a
# round trip per transaction on PyMySQL.
ENGINE_DEFAULTS: dict[str, Any] = {"pool_reset_on_return": None, "pool_pre_ping": False}


# -- plans ---------------------------------------------------------------------------------------


class DriverStatement:
    """A Core statement compiled once, by SQLAlchemy's compiler, for one dialect: the SQL text
    the DBAPI driver runs, and how a step's parameters are laid out for it.

    A statement run for every message is executed through this on the driver's own cursor
    (see :func:`run`), so SQLAlchemy's compile-cache lookup, execution context and result
    processing are paid once per store instead of once per statement. What that skips is made
    good here and in :func:`run`:

    * bound literals of the statement (a constant SQLAlchemy chose to bind) are filled in from
      the compiled statement;
    * a bind whose type converts values for this driver (a datetime written by sqlite3 as
      SQLAlchemy's text form) keeps that conversion, taken from the type's public
      ``bind_processor``; on psycopg and PyMySQL the plans' values need none;
    * rows come back as named tuples of the driver's values, so a plan reads them by name; no
      result processing runs (PyMySQL and sqlite3 return JSON and datetimes as text; the plans
      decode what they read: see :func:`idemq.stores.sql.plans.json_record`).

    ``statement`` stays the Core construct, for executors that compile it themselves.
    """

    def __init__(self, statement: Executable, dialect: sa.Dialect) -> None:
        compiled = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
        if not isinstance(compiled, SQLCompiler):
            raise TypeError(f"not a SQL statement: {statement!r}")
        # The binds by the names the SQL text uses (``binds`` also lists them by internal key).
        rendered = set(compiled.bind_names.values())
        binds = {name: bind for name, bind in compiled.binds.items() if name in rendered}
        self.statement = statement
        self.compiled = compiled
        self.sql = compiled.string
        self.sqlite = dialect.name == "sqlite"
        self.positions = compiled.positiontup if dialect.positional else None
        # IN lists of any length are rendered per call (SQLAlchemy's "expanding" binds).
        self.expanding = any(bind.expanding for bind in binds.values())
        self.literals = {
            name: bind.effective_value for name, bind in binds.items() if not bind.required
        }
        processors = {}
        for name, bind in binds.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                processors[name] = process
        self.processors = processors
        self._row: Any = None

    def __repr__(self) -> str:
        return f"DriverStatement({self.sql!r})"

    def bind(self, params: Mapping[str, Any]) -> tuple[str, Any]:
        """The SQL and the driver's parameters (a dict, or a tuple for a positional
        paramstyle) for this call's ``params``."""
        values = {**self.literals, **params} if self.literals else dict(params)
        for name, process in self.processors.items():
            if name in values:
                values[name] = process(values[name])
        if self.expanding:
            state = self.compiled.construct_expanded_state(values)
            if self.positions is None:
                return state.statement, state.parameters
            return state.statement, state.positional_parameters
        if self.positions is None:
            return self.sql, values
        return self.sql, tuple([values[name] for name in self.positions])

    def rows(self, names: Callable[[], Iterable[str]], rows: Iterable[Any]) -> list[Any]:
        """The driver's rows as named tuples, read by name like SQLAlchemy's rows (``names``:
        the result's column names, asked for once: every call returns the same columns)."""
        row = self._row
        if row is None:
            row = self._row = namedtuple("Row", list(names()), rename=True)
        return [row(*values) for values in rows]


class Step(NamedTuple):
    """One statement of a plan: a Core construct or ``text()`` built once, or a
    :class:`DriverStatement` compiled once, and this call's parameters (bind name → value)."""

    statement: Executable | DriverStatement
    params: Mapping[str, Any]


class Reply(NamedTuple):
    """What a plan gets back for one :class:`Step`: every row, buffered (SQLAlchemy's rows,
    or a :class:`DriverStatement`'s named tuples), and the row count."""

    rows: Sequence[Any]
    rowcount: int


Plan = Generator[Step, Reply, T]
"""A sans-I/O SQL plan: yields steps, receives each step's :class:`Reply`, returns ``T``."""


def run(conn: Connection | Session, plan: Plan[T], doing: str) -> T:
    """Carry out ``plan`` on ``conn`` (a ``Connection`` or ORM ``Session``) inside its current
    transaction; a database failure is raised into the plan as an idemq error naming ``doing``.

    A :class:`DriverStatement` runs on the DBAPI cursor of the connection the transaction
    holds (SQLAlchemy's "working with the DBAPI connection"). What SQLAlchemy would do around
    it is done here: the driver's error is translated by :func:`translate_db_error`; a
    connection the driver reports lost is invalidated, and the pool replaced, so neither it nor
    its pool-mates opened before the outage are handed out again;
    on SQLite a statement is refused once SQLite ended the transaction by itself
    (:func:`check_sqlite_transaction`).
    """
    connection = conn.connection() if isinstance(conn, Session) else conn
    return drive(plan, lambda step: run_step(connection, step, doing))


def run_step(connection: Connection, step: Step, doing: str) -> Reply:
    r"""One :class:`Step` on ``connection``, as :func:`run` runs it (for callers whose plans
    are not :data:`Plan`\ s: the outbox's add and its relay)."""
    statement = step.statement
    try:
        if isinstance(statement, DriverStatement):
            return _execute_on_cursor(connection, statement, step.params)
        result = connection.execute(statement, step.params)
        return Reply(result.all() if result.returns_rows else (), result.rowcount)
    except (SQLAlchemyError, OSError, connection.dialect.loaded_dbapi.Error) as error:
        raise translate_db_error(error, doing) from error


# The key of the cursor kept in a pooled connection's ``info`` (see :func:`_cursor`).
_CURSOR = "idemq.cursor"


def _cursor(info: dict[Any, Any], driver: Any) -> Any:
    """The cursor idemq's statements run on, for the DBAPI connection ``driver``: one per
    connection, kept in the pooled connection's ``info`` (SQLAlchemy's documented place for
    data that follows a DBAPI connection through the pool; emptied when it is replaced).

    A cursor made per statement cost psycopg 25 to 30 µs of client CPU each time (its adapters,
    its result machinery); every statement buffers its whole result (``fetchall``) before the
    next, so one cursor serves them all. A connection replaced (invalidated, recycled) starts
    with an empty ``info``, so a cursor is never used past its connection."""
    cursor = info.get(_CURSOR)
    if cursor is None:
        cursor = info[_CURSOR] = driver.cursor()
    return cursor


def _execute_on_cursor(
    connection: Connection, statement: DriverStatement, params: Mapping[str, Any]
) -> Reply:
    sql, args = statement.bind(params)
    pooled = connection.connection
    driver: Any = pooled.driver_connection
    if statement.sqlite:
        check_sqlite_transaction(connection, driver)
    dialect = connection.dialect
    cursor = _cursor(pooled.info, driver)
    try:
        cursor.execute(sql, args)
        description = cursor.description
        if description is None:
            return Reply((), cursor.rowcount)
        names = lambda: (column[0] for column in description)  # noqa: E731
        return Reply(statement.rows(names, cursor.fetchall()), cursor.rowcount)
    except dialect.loaded_dbapi.Error as error:
        if dialect.is_disconnect(error, driver, cursor):
            # What SQLAlchemy does on a disconnect: this connection is never handed out again,
            # nor are the pool's others, opened before it and most likely as dead (a server
            # restart, a failover): the pool is replaced, its idle connections closed.
            connection.invalidate(error)
            connection.engine.dispose()
        raise


async def arun(conn: AsyncConnection | AsyncSession, plan: Plan[T], doing: str) -> T:
    """:func:`run` on an ``AsyncConnection`` or ``AsyncSession``: the same plan, each step
    awaited (``AsyncConnection.execute`` buffers the whole result).

    A :class:`DriverStatement` runs on psycopg's own async cursor (the DBAPI connection of
    ``AsyncConnection.get_raw_connection()``), with :func:`run`'s care around it; on the other
    async drivers, whose connections share no cursor interface, through
    ``AsyncConnection.exec_driver_sql`` (compiled once all the same).
    """
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn

    async def execute(step: Step) -> Reply:
        return await arun_step(connection, step, doing)

    return await adrive(plan, execute)


async def arun_step(connection: AsyncConnection, step: Step, doing: str) -> Reply:
    """:func:`run_step` on an ``AsyncConnection``, as :func:`arun` runs a step."""
    statement = step.statement
    dialect = connection.dialect
    try:
        if isinstance(statement, DriverStatement):
            if dialect.driver == "psycopg":
                return await _aexecute_on_cursor(connection, statement, step.params)
            result = await connection.exec_driver_sql(*statement.bind(step.params))
            if not result.returns_rows:
                return Reply((), result.rowcount)
            return Reply(statement.rows(result.keys, result.all()), result.rowcount)
        result = await connection.execute(statement, step.params)
        return Reply(result.all() if result.returns_rows else (), result.rowcount)
    except (SQLAlchemyError, OSError, dialect.loaded_dbapi.Error) as error:
        raise translate_db_error(error, doing) from error


async def _aexecute_on_cursor(
    connection: AsyncConnection, statement: DriverStatement, params: Mapping[str, Any]
) -> Reply:
    sql, args = statement.bind(params)
    # The pooled connection the transaction holds, read off the sync-style Connection the
    # AsyncConnection proxies (no greenlet hand-off); get_raw_connection() (one each time) is
    # only needed when it has none, an invalidated one, where it raises.
    sync = connection.sync_connection
    pooled = (
        sync.connection
        if sync is not None and not sync.invalidated and not sync.closed
        else await connection.get_raw_connection()
    )
    driver: Any = pooled.driver_connection
    dialect = connection.dialect
    cursor = _cursor(pooled.info, driver)  # psycopg's async cursor, kept as the sync one is
    try:
        await cursor.execute(sql, args)
        description = cursor.description
        if description is None:
            return Reply((), cursor.rowcount)
        names = lambda: (column[0] for column in description)  # noqa: E731
        return Reply(statement.rows(names, await cursor.fetchall()), cursor.rowcount)
    except dialect.loaded_dbapi.Error as error:
        if dialect.is_disconnect(error, pooled.dbapi_connection, cursor):
            await connection.invalidate(error)  # see _execute_on_cursor
            await connection.engine.dispose()
        raise


# -- errors --------------------------------------------------------------------------------------

# Server error codes meaning "another transaction got in the way; run the whole thing again".
_PG_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03"})  # serialization, deadlock, lock
_MYSQL_RETRYABLE_ERRNOS = frozenset({1205, 1213})  # lock wait timeout, deadlock
# The server answered and refused this setup: retrying the same settings cannot help.
# login, db, table, a column the table lacks (a table of another shape by that name)
_PG_REFUSING_SQLSTATES = frozenset({"28000", "28P01", "3D000", "42P01", "42703"})
# access denied (db, user, auth plugin), unknown database, no such table
_MYSQL_REFUSING_ERRNOS = frozenset({1044, 1045, 1698, 1049, 1146, 1054})
# libpq reports a refused connection without a SQLSTATE: only the server's FATAL text tells a
# refusal (these, in the server's default English) from an outage. Anything not matched stays an
# outage, the safe side: "too many clients" or "starting up" pass once the server recovers.
_PG_REFUSING_TEXTS = (
    "authentication failed for user",  # password, SCRAM, ident, cert …
    "no pg_hba.conf entry",
    "no password supplied",
    "permission denied for database",
)
# A TLS connection refused on the client's side: the server's certificate is not signed by the
# CA given (sslrootcert, ssl_ca), names another host, or the CA file is missing; libpq also
# refuses a server without TLS when sslmode asks for it. The same settings fail the same way on
# every retry, so a worker retrying them as an outage would never get anywhere.
_TLS_REFUSING_TEXTS = (
    "certificate verify failed",  # libpq (Python's ssl module says the same)
    "does not match host name",  # libpq, sslmode=verify-full
    "root certificate file",  # libpq: sslrootcert missing or unreadable
    "server does not support SSL, but SSL was required",
)
_PG_MISSING_TEXT = re.compile(r'FATAL: +(role|database) "[^"]*" does not exist')
_SQLITE_MISSING = re.compile(r"no such table|no such column|table \S+ has no column named")
# A unique or primary key already holds the inserted value: PostgreSQL's unique_violation,
# MariaDB/MySQL's ER_DUP_ENTRY, SQLite's constraint message.
_PG_DUPLICATE_SQLSTATE = "23505"
_MYSQL_DUPLICATE_ERRNO = 1062
_SQLITE_DUPLICATE_TEXTS = ("UNIQUE constraint failed", "PRIMARY KEY must be unique")
# Statements the server could not run as written (PostgreSQL says so with ProgrammingError or
# DataError; PyMySQL and sqlite3 raise OperationalError, their class for outages too): a value
# that does not fit its column, a syntax error. Running them again fails the same way.
_MYSQL_STATEMENT_ERRNOS = frozenset({1264, 1265, 1292, 1366, 1406})
_SQLITE_STATEMENT_TEXT = re.compile(r'near ".*": syntax error')
# A password as drivers and SQLAlchemy may echo it: in a URL (user:secret@host) or a libpq
# conninfo string (password=secret), e.g. psycopg's "invalid dsn" message.
_SECRET = re.compile(r"(://[^:/@\s]*:)\S*@|(password\s*=\s*)('[^']*'|\S+)", re.IGNORECASE)
# SQLAlchemy's own errors (no driver error under them) that mean "no usable connection".
_UNREACHABLE = (
    OSError,
    exc.TimeoutError,  # the pool had no connection free within pool_timeout
    exc.DisconnectionError,
    exc.ResourceClosedError,
    exc.PendingRollbackError,  # the connection was invalidated inside the transaction
)


def translate_db_error(error: BaseException, doing: str) -> StoreError:
    """The idemq error a consumer can act on, for a failure while ``doing`` something.

    ``error`` is SQLAlchemy's (it wraps every driver's error in
    :class:`~sqlalchemy.exc.DBAPIError`) or a driver's own, raised on its cursor (psycopg,
    PyMySQL, sqlite3 and the async drivers: PEP 249 gives their classes the same names); both
    are read the same way:

    * deadlock / serialization failure / lock timeout → :class:`StoreConflictError` (roll back and
      run the message again: nothing was committed);
    * lost connection, timeouts, other operational failures, the pool's timeout, a closed or
      invalidated connection, a socket error → :class:`StoreUnavailableError`;
    * a refused login, an unknown database, a missing table or column (a table of another
      shape), a server certificate the given CA did not sign → :class:`StoreConfigurationError`
      (the same settings fail the same way: the CLI exits 2, not 4);
    * a key already taken → :class:`DuplicateKeyError`; another constraint violation →
      :class:`StoreIntegrityError`;
    * anything else (a statement the server or SQLAlchemy could not compile or bind) →
      :class:`StoreError`.

    ``doing`` names the statement or step, so a programming error says which one failed. The
    caller raises the returned error ``from`` the original, so it stays as ``__cause__``.
    Messages never include a password or the statement's parameters.
    """
    if isinstance(error, exc.DBAPIError):
        orig: BaseException | None = error.orig
        kinds = {cls.__name__ for cls in type(error).__mro__}
        invalidated = error.connection_invalidated
    elif _is_driver_error(error):
        orig = error
        kinds = {cls.__name__ for cls in type(error).__mro__}
        invalidated = False
    else:
        message = _without_secrets(f"{doing} failed: {type(error).__name__}: {error}")
        if isinstance(error, _UNREACHABLE):
            return StoreUnavailableError(message)
        return StoreError(message)
    sqlstate = getattr(orig, "sqlstate", None)
    args = getattr(orig, "args", ())
    errno = args[0] if args else None
    # First line only: driver messages can run on with the statement and its parameters.
    first_line = (str(orig).strip().splitlines() or [""])[0]
    message = _without_secrets(f"{doing} failed: {type(orig).__name__}: {first_line}")
    if sqlstate in _PG_RETRYABLE_SQLSTATES or errno in _MYSQL_RETRYABLE_ERRNOS:
        return StoreConflictError(message)
    if "IntegrityError" in kinds:
        duplicate = (
            sqlstate == _PG_DUPLICATE_SQLSTATE
            or errno == _MYSQL_DUPLICATE_ERRNO
            or first_line.startswith(_SQLITE_DUPLICATE_TEXTS)
        )
        return DuplicateKeyError(message) if duplicate else StoreIntegrityError(message)
    operational = bool(_OPERATIONAL & kinds)
    if operational and "database is locked" in str(orig):
        return StoreConflictError(message)  # SQLite busy timeout ran out
    if _refuses_setup(str(orig), sqlstate, errno):
        return StoreConfigurationError(message)
    if invalidated:
        return StoreUnavailableError(message)
    if errno in _MYSQL_STATEMENT_ERRNOS or _SQLITE_STATEMENT_TEXT.match(first_line):
        return StoreError(message)  # the statement cannot run as written: not an outage
    if operational:
        return StoreUnavailableError(message)
    return StoreError(message)


# The drivers idemq runs on, by top-level package; their errors are read by their PEP 249 names
# (SQLAlchemy's wrappers carry the same names: OperationalError, IntegrityError …).
_DRIVER_PACKAGES = frozenset({"psycopg", "pymysql", "sqlite3", "asyncmy", "aiosqlite", "MySQLdb"})
_OPERATIONAL = frozenset({"OperationalError", "InterfaceError"})


def _is_driver_error(error: BaseException) -> bool:
    """Whether ``error`` is a DBAPI driver's own exception (PEP 249's ``Error`` tree)."""
    package = type(error).__module__.partition(".")[0]
    return package in _DRIVER_PACKAGES and any(
        cls.__name__ == "Error" for cls in type(error).__mro__
    )


def _without_secrets(text: str) -> str:
    """``text`` with any password in it masked (see ``_SECRET``)."""
    return _SECRET.sub(lambda m: f"{m.group(1) or m.group(2)}***{'@' if m.group(1) else ''}", text)


def _refuses_setup(text: str, sqlstate: object, errno: object) -> bool:
    """Whether the server refused the login, the database or the table, or the client refused
    the server's certificate (see the constants)."""
    if sqlstate in _PG_REFUSING_SQLSTATES or errno in _MYSQL_REFUSING_ERRNOS:
        return True
    if _SQLITE_MISSING.match(text):
        return True
    if any(part in text for part in _TLS_REFUSING_TEXTS):
        return True
    return any(part in text for part in _PG_REFUSING_TEXTS) or bool(_PG_MISSING_TEXT.search(text))


def connection_lost(error: BaseException) -> bool:
    """Whether ``error``, raised by SQLAlchemy anywhere (a handler's own engine included), means
    the database could not be reached rather than that the statement failed.

    Narrower than :func:`translate_db_error`'s "unavailable": a connection SQLAlchemy found
    broken (``connection_invalidated``: the server closed it, the network dropped), a connect
    that failed (an ``OperationalError`` with no statement), the pool's own disconnection and
    timeout errors. A statement the server refused or cancelled (a statement timeout) is not:
    the same message would fail the same way every time, so it must count as an attempt.
    """
    if isinstance(error, exc.DisconnectionError | exc.TimeoutError | exc.PendingRollbackError):
        return True
    if isinstance(error, exc.DBAPIError):
        if error.connection_invalidated:
            return True
        return isinstance(error, exc.OperationalError) and error.statement is None
    return False


def driver_reports_aborts(dialect: sa.Dialect) -> bool:
    """Whether the driver's connection says, without a round trip, that its transaction is
    still usable: PostgreSQL aborts a transaction at its first failed statement (a COMMIT of it
    then rolls back, and the driver reports that COMMIT as a success), and psycopg keeps the
    server's transaction status on the connection."""
    return dialect.name == "postgresql" and dialect.driver == "psycopg"


def transaction_lost_reason(driver_connection: Any) -> str | None:
    """Why psycopg's ``driver_connection`` (sync or async) holds no usable transaction, or
    None when it is inside one (``TransactionStatus.INTRANS``); reads the status the server
    sent with its last reply, so it costs no round trip."""
    from psycopg.pq import TransactionStatus  # noqa: PLC0415 -- psycopg is an optional extra

    status = driver_connection.info.transaction_status
    if status == TransactionStatus.INTRANS:
        return None
    if status == TransactionStatus.INERROR:
        return (
            "a statement inside it failed and PostgreSQL aborted it (a handler caught the error "
            "without a savepoint of its own: tx.begin_nested()); its COMMIT would roll back"
        )
    if status == TransactionStatus.IDLE:
        return "it was ended (committed or rolled back) by a statement the handler ran"
    return f"its connection is {TransactionStatus(status).name}"


def transaction_aborted(driver_connection: Any) -> bool:
    """Whether psycopg's ``driver_connection`` is in a transaction a failed statement aborted
    (``TransactionStatus.INERROR``; no round trip). Unlike :func:`transaction_lost_reason`, a
    transaction that has not sent its first statement yet (IDLE: psycopg begins lazily) is
    not aborted."""
    from psycopg.pq import TransactionStatus  # noqa: PLC0415 -- psycopg is an optional extra

    return bool(driver_connection.info.transaction_status == TransactionStatus.INERROR)


@contextmanager
def translated(doing: str) -> Iterator[None]:
    """Raise a database failure inside the block as :func:`translate_db_error`'s error."""
    try:
        yield
    except (SQLAlchemyError, OSError) as error:
        raise translate_db_error(error, doing) from error


def create_table_once(engine: Engine, table: sa.Table) -> None:
    """Create ``table`` if it is missing. Processes starting together race between the
    existence check and the ``CREATE``; losing that race is no failure (the winner's table is
    used), so only a table still missing afterwards is an error, the first one's."""
    doing = f"create table {table.name!r}"
    try:
        with translated(doing):
            table.create(engine, checkfirst=True)
    except StoreError:
        try:
            with translated(doing):
                exists = sa.inspect(engine).has_table(table.name, schema=table.schema)
        except StoreError:
            exists = False  # the database cannot be reached: the first failure says so
        if not exists:
            raise


def _check_still_open(in_transaction: bool, where: str) -> None:
    # A block that closed, committed or rolled back the connection itself (a handler calling
    # ``tx.close()``) leaves nothing for this COMMIT: reporting success would claim a dedup row
    # and an effect that were never committed together.
    if not in_transaction:
        raise StoreError(
            f"the transaction on {where} was ended inside its block (closed, committed or "
            "rolled back by the code it ran): the message was not recorded as processed"
        )


# How long a kept connection may sit unused before it goes back to the pool (see Transactions).
KEEP_IDLE_S = 1.0

# Connections a forked child found kept by its parent: never used nor closed in the child (their
# sockets are the parent's), only held, so no garbage collection acts on them either.
_INHERITED: list[Connection] = []


class Transactions:
    """Where a store's own transactions come from: ``engine.begin()``, with the connection of
    the last one kept for the next.

    A consumer runs one transaction per message; checking a connection out of SQLAlchemy's
    pool and building a ``Connection`` around it, then closing both, cost 40 to 60 µs of client
    CPU per message on psycopg (``bench/sql_guard.py``). So the connection of a transaction
    that ended is kept (one per store) and the next transaction begins on it (one invalidated
    gets a fresh connection from the pool there, as SQLAlchemy revalidates); one closed or given
    other execution options by the code inside (options set on a ``Connection`` stay on it)
    goes back to the pool.

    What the pool does at checkout still applies: a connection kept longer than
    :data:`KEEP_IDLE_S` unused goes back to it, and the next transaction checks one out, so a
    consumer that paused meets the engine's ``pool_pre_ping`` and ``pool_recycle`` as before.
    Only ``QueuePool`` engines keep one (the default for PostgreSQL, MariaDB and SQLite files):
    a ``NullPool`` engine is one whose owner asked for no connection to outlive its use. Other
    threads find the kept connection taken and use the pool, so no more connections are open
    than the pool allows. After ``os.fork()`` the child never uses its parent's (see
    :data:`_INHERITED`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.keeps = isinstance(engine.pool, QueuePool)
        # (connection, when it was kept, by which process); one at most: the last one.
        self._kept: deque[tuple[Connection, float, int]] = deque()

    def _connect(self) -> Connection:
        try:
            conn, since, pid = self._kept.pop()
        except IndexError:
            return self.engine.connect()
        if pid != os.getpid():
            _INHERITED.append(conn)
        elif time.monotonic() - since > KEEP_IDLE_S:
            conn.close()
        else:
            return conn
        return self.engine.connect()

    def _done(self, conn: Connection, options: Mapping[str, Any]) -> None:
        if (
            self.keeps
            and not self._kept
            and not conn.closed
            and conn.get_execution_options() is options
        ):
            self._kept.append((conn, time.monotonic(), os.getpid()))
        else:
            conn.close()

    @contextmanager
    def begin(self, where: str) -> Iterator[Connection]:
        """A transaction that commits when the block ends and rolls back when it raises. A
        failure to connect, begin, commit or roll back is translated; the block's own exception
        propagates as it is."""
        doing = "begin"
        raised: BaseException | None = None
        try:
            conn = self._connect()
            options = conn.get_execution_options()
            try:
                with conn.begin():
                    doing = "commit"
                    try:
                        yield conn
                    except BaseException as body_error:
                        doing, raised = "rollback", body_error
                        raise
                    _check_still_open(conn.in_transaction(), where)
            finally:
                self._done(conn, options)
        except (SQLAlchemyError, OSError, self.engine.dialect.loaded_dbapi.Error) as error:
            if error is raised:
                raise
            raise translate_db_error(error, f"{doing} on {where}") from error

    def close(self) -> None:
        """Give the kept connection back to the pool (a store's ``close``, before disposing)."""
        while self._kept:
            try:
                conn, _since, pid = self._kept.pop()
            except IndexError:
                return
            if pid == os.getpid():
                conn.close()
            else:
                _INHERITED.append(conn)


@asynccontextmanager
async def abegin(engine: AsyncEngine, where: str) -> AsyncIterator[AsyncConnection]:
    """:meth:`Transactions.begin` for an ``AsyncEngine``, with no connection kept: SQLAlchemy's
    asyncio pool warns of, and terminates, a checked-out connection the garbage collector finds,
    so a store left unclosed would log an error at exit."""
    doing = "begin"
    raised: BaseException | None = None
    try:
        async with engine.begin() as conn:
            doing = "commit"
            try:
                yield conn
            except BaseException as body_error:
                doing, raised = "rollback", body_error
                raise
            _check_still_open(conn.in_transaction(), where)
    except (SQLAlchemyError, OSError, engine.dialect.loaded_dbapi.Error) as error:
        if error is raised:
            raise
        raise translate_db_error(error, f"{doing} on {where}") from error


# -- engines -------------------------------------------------------------------------------------


def parse_url(url: str | URL) -> URL:
    """``url`` as a SQLAlchemy URL; :class:`~idemq.ConfigurationError` if it is not one."""
    try:
        return make_url(url)
    except (ArgumentError, ValueError) as error:  # ValueError: a port that is not a number
        shown = mask_url(url) if isinstance(url, str) else url.render_as_string(hide_password=True)
        raise ConfigurationError(f"not a database URL: {shown}") from error


def sync_url(url: URL) -> URL:
    """Bare scheme → the driver idemq is tested with (psycopg 3, PyMySQL)."""
    drivers = {
        "postgresql": "postgresql+psycopg",
        "mysql": "mysql+pymysql",
        "mariadb": "mariadb+pymysql",
    }
    return url.set(drivername=drivers.get(url.drivername, url.drivername))


def async_url(url: URL) -> URL:
    """Any scheme → its asyncio driver (psycopg 3 async, asyncmy, aiosqlite)."""
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


def _unusable_driver(url: URL, error: Exception) -> ConfigurationError:
    """Why ``url``'s driver cannot be used; a missing one names the extra that installs it."""
    # The driver as written (get_driver_name() would load the dialect, which may be the error).
    extra = SQL_DRIVER_EXTRAS.get(url.drivername.partition("+")[2])
    if isinstance(error, ImportError) and extra is not None:
        return missing_extra(f"a {url.drivername} store", extra, error)
    return ConfigurationError(f"cannot use {url.drivername!r}: {error}")


def engine_from_url(url: str | URL, **engine_kwargs: Any) -> Engine:
    """A sync engine for a store: :data:`ENGINE_DEFAULTS` (overridden by ``engine_kwargs``), SQLite
    prepared, inherited connections discarded after a fork."""
    parsed = sync_url(parse_url(url))
    try:
        engine = sa.create_engine(parsed, **{**ENGINE_DEFAULTS, **engine_kwargs})
    except (ArgumentError, NoSuchModuleError, ImportError) as error:
        raise _unusable_driver(parsed, error) from error
    if engine.dialect.name == "sqlite":
        prepare_sqlite(engine)
    discard_inherited_connections(engine)
    return engine


def async_engine_from_url(url: str | URL, **engine_kwargs: Any) -> AsyncEngine:
    """:func:`engine_from_url` for an async store (the same events, on its ``sync_engine``)."""
    parsed = parse_url(url)
    try:
        engine = create_async_engine(async_url(parsed), **engine_kwargs)
    except (ArgumentError, NoSuchModuleError, ImportError) as error:
        raise _unusable_driver(parsed, error) from error
    if engine.dialect.name == "sqlite":
        prepare_sqlite(engine.sync_engine)
    discard_inherited_connections(engine.sync_engine)
    return engine


def prepare_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, and ``BEGIN IMMEDIATE`` for every transaction on ``engine``.

    SQLAlchemy's documented recipe ("Enabling Non-Legacy SQLite Transactional Modes"): the
    driver's own transaction handling is switched off on connect, and the engine's ``begin``
    event emits the ``BEGIN``. It holds for idemq's transactions and for the caller's own
    ``engine.begin()`` alike, and makes SAVEPOINT work. For aiosqlite, pass ``sync_engine``.
    """

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # On the DBAPI cursor, not exec_driver_sql: no execution context nor statement events
        # for a statement every transaction sends. SQLAlchemy does not wrap an error raised
        # here, so Transactions.begin()/abegin() translate the driver's own error.
        cursor = conn.connection.cursor()
        try:
            cursor.execute("BEGIN IMMEDIATE")
        finally:
            cursor.close()

    @event.listens_for(engine, "before_cursor_execute")
    def _still_in_transaction(conn: Connection, *_args: Any) -> None:
        check_sqlite_transaction(conn, conn.connection.driver_connection)


def check_sqlite_transaction(conn: Connection, driver_connection: Any) -> None:
    """Raise :class:`TransactionLostError` before a statement on SQLite's ``conn`` once SQLite
    ended its transaction by itself.

    SQLite rolls a whole transaction back by itself on some errors (a conflict clause OR
    ROLLBACK, RAISE(ROLLBACK) in a trigger, a full disk). With the driver's own transaction
    handling off (:func:`prepare_sqlite`), every later statement would then commit on its own,
    out of reach of the ROLLBACK that follows: a handler that caught the error would commit its
    later writes without the dedup row, and run them again on the retry. So a statement is
    refused while SQLAlchemy's transaction is open but sqlite3's (``driver_connection``) is gone.
    Checked before every statement: SQLAlchemy's (the ``before_cursor_execute`` hook) and the
    ones :func:`run` sends on the driver's cursor.
    """
    if (
        conn.in_transaction()
        and driver_connection is not None
        and not driver_connection.in_transaction
    ):
        raise TransactionLostError(
            "SQLite rolled this transaction back by itself (an error inside it): no "
            "statement runs outside it; nothing of it is committed"
        )


def discard_inherited_connections(engine: Engine) -> None:
    """After ``os.fork()``, the child opens its own connections instead of using its parent's.

    SQLAlchemy's documented recipe ("Using Connection Pools with Multiprocessing or os.fork()"):
    each pooled connection remembers the process that opened it, and a checkout in another
    process drops it from the pool without closing it (the parent still uses that socket), so
    the pool connects anew.
    """

    @event.listens_for(engine, "connect")
    def _connect(_dbapi_connection: Any, record: Any) -> None:
        record.info["pid"] = os.getpid()

    @event.listens_for(engine, "checkout")
    def _checkout(_dbapi_connection: Any, record: Any, proxy: Any) -> None:
        pid = os.getpid()
        if record.info["pid"] != pid:
            record.dbapi_connection = proxy.dbapi_connection = None
            raise exc.DisconnectionError(
                f"connection opened by process {record.info['pid']}, checked out in {pid}"
            )


def sql_engine(engine_or_url: sa.Engine | str) -> sa.Engine:
    """An Engine handed in (returned as is, the caller's own), or :func:`engine_from_url`'s."""
    if isinstance(engine_or_url, sa.Engine):
        return engine_or_url
    return engine_from_url(engine_or_url)
