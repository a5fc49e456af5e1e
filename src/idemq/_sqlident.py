"""Shared SQL plumbing for the business-row guards (state machine, version CAS).

Three jobs, each done once for both guards and for both the sync and the async flavour:

* **Identifier validation.** Table and column names end up in SQL text, so they are checked
  against a strict pattern when a guard is configured; values always travel as bound parameters.
* **Statement building** with SQLAlchemy Core's lightweight ``table()``/``column()`` constructs,
  so quoting and placeholder style come from the dialect (SQLite, PostgreSQL, MariaDB alike).
* **Driving a plan.** A guard's logic is written once as a generator that *yields* statements and
  receives their results (no I/O inside). :func:`run_plan` and :func:`run_plan_async` are the
  only places that touch a connection; they are the thin sync and async shells, and the boundary
  where driver errors are translated into :mod:`idemq.errors`.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import column, exc, table
from sqlalchemy.sql.expression import ColumnClause, Executable, TableClause

from idemq.errors import (
    ConfigurationError,
    StoreConflictError,
    StoreError,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, CursorResult
    from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = [
    "MAX_IDENTIFIER_LEN",
    "Plan",
    "check_columns",
    "check_identifier",
    "run_plan",
    "run_plan_async",
    "table_clause",
    "translate_db_error",
]

T = TypeVar("T")

#: A guard's logic: yields statements, receives each statement's (buffered) result, returns T.
Plan = Generator[Executable, "CursorResult[Any]", T]

#: PostgreSQL truncates identifiers at 63 bytes (MariaDB allows 64): refuse rather than truncate.
MAX_IDENTIFIER_LEN = 63
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Server error codes meaning "another transaction got in the way; run the whole thing again".
_PG_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03"})  # serialization, deadlock, lock
_MYSQL_RETRYABLE_ERRNOS = frozenset({1205, 1213})  # lock wait timeout, deadlock


def check_identifier(name: object, what: str) -> str:
    """Return ``name`` if it is a plain SQL identifier, else raise ConfigurationError.

    Only ``[A-Za-z_][A-Za-z0-9_]*`` up to 63 characters is accepted: no quotes, spaces, dots or
    semicolons, so a name taken from configuration can never smuggle SQL into a statement.
    """
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{what} must be a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*), got {name!r}"
        )
    if len(name) > MAX_IDENTIFIER_LEN:
        raise ConfigurationError(f"{what} {name!r} is longer than {MAX_IDENTIFIER_LEN} characters")
    return name


def check_columns(names: Mapping[str, object], what: str, reserved: set[str]) -> list[str]:
    """Validate the column names of a ``values`` mapping; none may be one of ``reserved``.

    ``reserved`` holds the columns the guard itself writes or filters on (key, state, version,
    fence): letting a caller set them would bypass the very check the guard exists for.
    """
    out: list[str] = []
    for name in names:
        check_identifier(name, f"{what} column")
        if name in reserved:
            raise ConfigurationError(
                f"{what} may not set {name!r}: that column is managed by the guard"
            )
        out.append(name)
    return out


@lru_cache(maxsize=256)
def table_clause(name: str, *columns: str) -> TableClause:
    """A lightweight table construct for ``name`` (optionally ``schema.table``) with ``columns``.

    Every part is validated; the result is cached because guards build the same shapes over and
    over (and SQLAlchemy's statement cache keys on their structure anyway).
    """
    schema: str | None = None
    if isinstance(name, str) and name.count(".") == 1:
        schema, name = name.split(".")
        check_identifier(schema, "schema name")
    check_identifier(name, "table name")
    cols: list[ColumnClause[Any]] = [column(check_identifier(c, "column name")) for c in columns]
    return table(name, *cols, schema=schema)


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


def run_plan(conn: Connection, plan: Plan[T], doing: str) -> T:
    """Drive ``plan`` on a sync SQLAlchemy ``Connection`` (the thin sync shell)."""
    try:
        statement = next(plan)
        while True:
            try:
                result = conn.execute(statement)
            except exc.DBAPIError as error:
                raise translate_db_error(error, doing) from error
            statement = plan.send(result)
    except StopIteration as done:
        value: T = done.value
        return value


async def run_plan_async(conn: AsyncConnection, plan: Plan[T], doing: str) -> T:
    """Drive ``plan`` on an ``AsyncConnection`` (the thin async shell).

    ``AsyncConnection.execute`` returns a fully buffered ``CursorResult``, so the plan reads
    ``rowcount`` and rows from it exactly as in the sync shell.
    """
    try:
        statement = next(plan)
        while True:
            try:
                result = await conn.execute(statement)
            except exc.DBAPIError as error:
                raise translate_db_error(error, doing) from error
            statement = plan.send(result)
    except StopIteration as done:
        value: T = done.value
        return value
