"""What the business-row guards (state machine, version CAS) share to build their statements.

* **Identifier validation.** Table and column names end up in SQL text, so they are checked
  against a strict pattern when a guard is configured: a name taken from configuration can never
  smuggle SQL into a statement. Values always travel as bound parameters.
* **Statement building** with SQLAlchemy Core's lightweight ``table()``/``column()`` constructs,
  so quoting and placeholder style come from the dialect (SQLite, PostgreSQL, MariaDB alike).
  Each guard builds a statement once per *shape* of call and runs it through
  :func:`idemq.drivers.sql.run` (``Connection.execute``), where SQLAlchemy's compiled cache
  finds it again.
* **The fence rule**, written once for both guards (:func:`fence_accepts`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from sqlalchemy import ColumnElement, bindparam, column, literal, or_, table
from sqlalchemy.sql.expression import ColumnClause, TableClause
from sqlalchemy.types import TypeEngine

from idemq.errors import ConfigurationError

__all__ = [
    "MAX_IDENTIFIER_LEN",
    "bind_prefix",
    "bind_type",
    "check_columns",
    "check_identifier",
    "fence_accepts",
    "table_clause",
]

#: PostgreSQL truncates identifiers at 63 bytes (MariaDB allows 64): refuse rather than truncate.
MAX_IDENTIFIER_LEN = 63
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


def check_columns(names: Iterable[object], what: str, reserved: set[str]) -> None:
    """Validate the column names of a ``values`` mapping; none may be one of ``reserved``.

    ``reserved`` holds the columns the guard itself writes or filters on (key, state, version,
    fence): letting a caller set them would bypass the very check the guard exists for.
    """
    for name in names:
        check_identifier(name, f"{what} column")
        if name in reserved:
            raise ConfigurationError(
                f"{what} may not set {name!r}: that column is managed by the guard"
            )


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


def fence_accepts(fence_col: ColumnClause[Any], fence_bind: str) -> ColumnElement[bool]:
    """The WHERE clause of a fenced write: the row's token, if any, is at most the bound one.

    One rule for both guards: NULL means never fenced, and an equal token is the same lock
    holder writing again; only an older token than one the row has seen is refused.
    """
    return or_(fence_col.is_(None), fence_col <= bindparam(fence_bind))


def bind_prefix(columns: Iterable[str]) -> str:
    """A prefix for a statement's bind names that begins none of its ``columns``' names.

    ``Connection.execute`` turns a parameter named like a column of an UPDATE into one more
    SET entry: a bind named like the key column (a key column called ``k``, say) would make
    SQLAlchemy refuse the statement, or write the key.
    """
    prefix = "b_"
    while any(name.startswith(prefix) for name in columns):
        prefix = "_" + prefix
    return prefix


_INFERRED: dict[type, TypeEngine[Any]] = {}


def bind_type(value: object) -> TypeEngine[Any]:
    """The SQL type SQLAlchemy gives a bind of ``value`` (``uuid.UUID`` → ``Uuid``, ``int`` →
    ``Integer`` …), inferred once per Python type.

    A statement built once and run with many keys has no value to infer the key's type from; a
    ``uuid.UUID`` key bound untyped would reach SQLite's driver unconverted and fail. So the
    key's type is part of a statement's shape, and its bind is typed with it, as a statement
    built per call with the value would be.
    """
    kind = type(value)
    inferred = _INFERRED.get(kind)
    if inferred is None:
        inferred = _INFERRED[kind] = literal(value).type
    return inferred
