"""Optimistic version compare-and-set on a business row, with optional fencing.

::

    UPDATE accounts SET balance = :balance, version = version + 1 [, fence_token = :fence]
     WHERE account_id = :key AND version = :expected
       [AND (fence_token IS NULL OR fence_token <= :fence)]

The reader remembers the ``version`` it read; the write succeeds only if nobody wrote in
between. Of N workers that read version 7 and race to write, the database lets exactly one
UPDATE match (the others re-evaluate ``version = 7`` against the committed 8 and match nothing),
so :func:`versioned_update` returns True exactly once per version. A False means "re-read and
decide again" (or: someone already did it).

Fencing closes the gap a distributed lock leaves open: a worker that paused (GC, network) past
its lock TTL still believes it holds the lock. Its write carries the fencing token it got with
the lock; the row remembers the highest token that wrote to it and refuses older ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import Integer, Update, bindparam, literal_column, update

from idemq.business._sql import (
    bind_prefix,
    bind_type,
    check_columns,
    check_identifier,
    fence_accepts,
)
from idemq.business._sql import table_clause as _table
from idemq.drivers.sql import Plan, Step, arun, run
from idemq.errors import ConfigurationError, InvalidInputError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session
    from sqlalchemy.types import TypeEngine

__all__ = ["versioned_update", "versioned_update_async"]


def versioned_update(  # noqa: PLR0917 -- positional shape fixed by the public contract
    conn: Connection | Session,
    table: str,
    key_column: str,
    key: Any,
    expected_version: int,
    values: Mapping[str, Any],
    version_column: str = "version",
    *,
    fence: int | None = None,
    fence_column: str = "fence_token",
) -> bool:
    """Write ``values`` and bump the version iff the row is still at ``expected_version``.

    Runs inside the current transaction of ``conn`` (a ``Connection`` or an ORM ``Session``;
    commit is the caller's). Returns True when this call wrote the row, False when the version
    moved on, the key does not exist, or — with ``fence`` — the row has already been written
    under a larger fencing token. Table and column names are validated
    (→ :class:`~idemq.ConfigurationError`); every value is a bound parameter. Database failures
    raise :class:`~idemq.StoreError` subclasses (cause kept).
    """
    plan = _plan(
        table=table,
        key_column=key_column,
        key=key,
        expected_version=expected_version,
        values=values,
        version_column=version_column,
        fence=fence,
        fence_column=fence_column,
    )
    return run(conn, plan, f"versioned update of {table}")


async def versioned_update_async(  # noqa: PLR0917 -- mirrors versioned_update
    conn: AsyncConnection | AsyncSession,
    table: str,
    key_column: str,
    key: Any,
    expected_version: int,
    values: Mapping[str, Any],
    version_column: str = "version",
    *,
    fence: int | None = None,
    fence_column: str = "fence_token",
) -> bool:
    """:func:`versioned_update` on a SQLAlchemy ``AsyncConnection``; same statement, same result."""
    plan = _plan(
        table=table,
        key_column=key_column,
        key=key,
        expected_version=expected_version,
        values=values,
        version_column=version_column,
        fence=fence,
        fence_column=fence_column,
    )
    return await arun(conn, plan, f"versioned update of {table}")


def _plan(
    *,
    table: str,
    key_column: str,
    key: Any,
    expected_version: int,
    values: Mapping[str, Any],
    version_column: str,
    fence: int | None,
    fence_column: str,
) -> Plan[bool]:
    """The CAS, written once for both shells: one UPDATE, decided by its rowcount."""
    # Checked before the statement cache: a name that is not a str must not reach its key.
    check_identifier(key_column, "key_column")
    check_identifier(version_column, "version_column")
    check_identifier(fence_column, "fence_column")
    for name, number in (("expected_version", expected_version), ("fence", fence)):
        # bool is an int subclass: True would silently compare as version/token 1.
        if (number is not None or name == "expected_version") and (
            isinstance(number, bool) or not isinstance(number, int)
        ):
            raise InvalidInputError(f"{name} must be an int, got {number!r}")
    shape = _shape(
        table,
        key_column,
        version_column,
        fence_column,
        tuple(values),
        fence is not None,
        bind_type(key),
    )
    b = shape.bind_prefix
    params = {f"{b}key": key, f"{b}expected": expected_version}
    if fence is not None:
        params[f"{b}fence"] = fence
    for bind, value in zip(shape.value_binds, values.values(), strict=True):
        params[bind] = value

    matched = (yield Step(shape.update, params)).rowcount
    if matched > 1:
        raise ConfigurationError(
            f"{table}.{key_column} is not unique: {matched} rows matched {key!r}; "
            "roll back the transaction"
        )
    return matched == 1


@dataclass(frozen=True, slots=True)
class _Shape:
    update: Update
    bind_prefix: str  # of the key, expected-version and fence binds
    value_binds: tuple[str, ...]  # the bind of each value column, in order


@lru_cache(maxsize=256)
def _shape(  # noqa: PLR0917 -- the cache key: every part of the statement's shape
    table: str,
    key_column: str,
    version_column: str,
    fence_column: str,
    value_cols: tuple[str, ...],
    fenced: bool,
    key_type: TypeEngine[Any],
) -> _Shape:
    """The UPDATE of one kind of call, built once (the key's type: see
    :func:`idemq.business._sql.bind_type`)."""
    managed = {key_column, version_column, fence_column}
    if len(managed) != 3:
        raise ConfigurationError(
            "key_column, version_column and fence_column must differ, got "
            f"{[key_column, version_column, fence_column]}"
        )
    check_columns(value_cols, "values", managed)

    tbl = _table(table, key_column, version_column, fence_column, *value_cols)
    b = bind_prefix(tbl.c.keys())
    value_binds = tuple(f"{b}value{i}" for i in range(len(value_cols)))
    version_col, fence_col = tbl.c[version_column], tbl.c[fence_column]
    new_values: dict[str, Any] = {
        **{col: bindparam(v) for col, v in zip(value_cols, value_binds, strict=True)},
        version_column: version_col + literal_column("1"),
    }
    stmt = update(tbl).where(
        tbl.c[key_column] == bindparam(f"{b}key", type_=key_type),
        version_col == bindparam(f"{b}expected", type_=Integer()),
    )
    if fenced:
        new_values[fence_column] = bindparam(f"{b}fence")
        stmt = stmt.where(fence_accepts(fence_col, f"{b}fence"))
    return _Shape(stmt.values(new_values), b, value_binds)
