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
* :func:`begin` / :func:`abegin` are ``engine.begin()`` with those errors translated for the
  connect, ``BEGIN``, ``COMMIT`` and ``ROLLBACK`` only: what the block itself raises (a handler's
  own error) propagates untouched.
* :func:`run` / :func:`arun` carry out a sans-I/O SQL :data:`Plan` (the stores' primitives, the
  business guards) on a connection through ``Connection.execute``, one :class:`Step` at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable

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
    "Plan",
    "Reply",
    "Step",
    "abegin",
    "arun",
    "async_engine_from_url",
    "async_url",
    "begin",
    "connection_lost",
    "create_table_once",
    "discard_inherited_connections",
    "driver_reports_aborts",
    "engine_from_url",
    "parse_url",
    "prepare_sqlite",
    "run",
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


class Step(NamedTuple):
    """One statement of a plan: a Core construct or ``text()`` built once, and this call's
    parameters (bind name → value)."""

    statement: Executable
    params: Mapping[str, Any]


class Reply(NamedTuple):
    """What a plan gets back for one :class:`Step`: every row, buffered, and the row count."""

    rows: Sequence[sa.Row[Any]]
    rowcount: int


Plan = Generator[Step, Reply, T]
"""A sans-I/O SQL plan: yields steps, receives each step's :class:`Reply`, returns ``T``."""


def run(conn: Connection | Session, plan: Plan[T], doing: str) -> T:
    """Carry out ``plan`` on ``conn`` (a ``Connection`` or ORM ``Session``) inside its current
    transaction; a database failure is raised into the plan as an idemq error naming ``doing``."""
    connection = conn.connection() if isinstance(conn, Session) else conn

    def execute(step: Step) -> Reply:
        try:
            result = connection.execute(step.statement, step.params)
            return Reply(result.all() if result.returns_rows else (), result.rowcount)
        except (SQLAlchemyError, OSError) as error:
            raise translate_db_error(error, doing) from error

    return drive(plan, execute)


async def arun(conn: AsyncConnection | AsyncSession, plan: Plan[T], doing: str) -> T:
    """:func:`run` on an ``AsyncConnection`` or ``AsyncSession``: the same plan, each step
    awaited (``AsyncConnection.execute`` buffers the whole result)."""
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn

    async def execute(step: Step) -> Reply:
        try:
            result = await connection.execute(step.statement, step.params)
            return Reply(result.all() if result.returns_rows else (), result.rowcount)
        except (SQLAlchemyError, OSError) as error:
            raise translate_db_error(error, doing) from error

    return await adrive(plan, execute)


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
    if not isinstance(error, exc.DBAPIError):
        message = _without_secrets(f"{doing} failed: {type(error).__name__}: {error}")
        if isinstance(error, _UNREACHABLE):
            return StoreUnavailableError(message)
        return StoreError(message)
    orig = error.orig
    sqlstate = getattr(orig, "sqlstate", None)
    args = getattr(orig, "args", ())
    errno = args[0] if args else None
    # First line only: driver messages can run on with the statement and its parameters.
    first_line = (str(orig).strip().splitlines() or [""])[0]
    message = _without_secrets(f"{doing} failed: {type(orig).__name__}: {first_line}")
    if sqlstate in _PG_RETRYABLE_SQLSTATES or errno in _MYSQL_RETRYABLE_ERRNOS:
        return StoreConflictError(message)
    if isinstance(error, exc.IntegrityError):
        duplicate = (
            sqlstate == _PG_DUPLICATE_SQLSTATE
            or errno == _MYSQL_DUPLICATE_ERRNO
            or first_line.startswith(_SQLITE_DUPLICATE_TEXTS)
        )
        return DuplicateKeyError(message) if duplicate else StoreIntegrityError(message)
    if isinstance(error, exc.OperationalError) and "database is locked" in str(orig):
        return StoreConflictError(message)  # SQLite busy timeout ran out
    if _refuses_setup(str(orig), sqlstate, errno):
        return StoreConfigurationError(message)
    if error.connection_invalidated:
        return StoreUnavailableError(message)
    if errno in _MYSQL_STATEMENT_ERRNOS or _SQLITE_STATEMENT_TEXT.match(first_line):
        return StoreError(message)  # the statement cannot run as written: not an outage
    if isinstance(error, exc.OperationalError | exc.InterfaceError):
        return StoreUnavailableError(message)
    return StoreError(message)


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


@contextmanager
def begin(engine: Engine, where: str) -> Iterator[Connection]:
    """``engine.begin()``: a pooled connection in a transaction that commits when the block ends
    and rolls back when it raises. A failure to connect, begin, commit or roll back is
    translated; the block's own exception propagates as it is."""
    doing = "begin"
    raised: BaseException | None = None
    try:
        with engine.begin() as conn:
            doing = "commit"
            try:
                yield conn
            except BaseException as body_error:
                doing, raised = "rollback", body_error
                raise
            _check_still_open(conn.in_transaction(), where)
    except (SQLAlchemyError, OSError) as error:
        if error is raised:
            raise
        raise translate_db_error(error, f"{doing} on {where}") from error


def _check_still_open(in_transaction: bool, where: str) -> None:
    # A block that closed, committed or rolled back the connection itself (a handler calling
    # ``tx.close()``) leaves nothing for this COMMIT: reporting success would claim a dedup row
    # and an effect that were never committed together.
    if not in_transaction:
        raise StoreError(
            f"the transaction on {where} was ended inside its block (closed, committed or "
            "rolled back by the code it ran): the message was not recorded as processed"
        )


@asynccontextmanager
async def abegin(engine: AsyncEngine, where: str) -> AsyncIterator[AsyncConnection]:
    """:func:`begin` for an ``AsyncEngine``."""
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
    except (SQLAlchemyError, OSError) as error:
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
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    @event.listens_for(engine, "before_cursor_execute")
    def _still_in_transaction(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        # SQLite rolls a whole transaction back by itself on some errors (a conflict clause
        # OR ROLLBACK, RAISE(ROLLBACK) in a trigger, a full disk). With the driver's own
        # transaction handling off, every later statement would then commit on its own, out
        # of reach of the ROLLBACK that follows: a handler that caught the error would commit
        # its later writes without the dedup row, and run them again on the retry. So a
        # statement is refused while SQLAlchemy's transaction is open but SQLite's is gone.
        driver = conn.connection.driver_connection
        if (
            conn.in_transaction()
            and driver is not None
            and not driver.in_transaction
            and not statement.startswith("BEGIN")
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
