"""The ``message_idempotent`` table, defined once for every SQL dialect.

Keys must be *exact* on every backend: ``"Case"``/``"case"``, ``"pad"``/``"pad "`` and
``"é"``/``"e\\u0301"`` are different messages. PostgreSQL and SQLite compare bytes by default;
MySQL/MariaDB do not (case-insensitive, PAD SPACE collations), so the key columns there get a
binary NO PAD collation — otherwise two different messages would share one dedup row and the
second one's effect would silently never happen.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateIndex, CreateTable
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import TypeDecorator

from idemq.errors import ConfigurationError

__all__ = [
    "DEFAULT_TABLE",
    "SCHEMA_VERSION",
    "UtcDateTime",
    "as_utc",
    "build_table",
    "collation_for",
    "ddl",
]

DEFAULT_TABLE = "message_idempotent"

#: The dedup table's schema version as :func:`build_table` defines it. 1: idemq 0.1.0's table;
#: 2: adds ``ix_<table>_message_id``, so ``idemq inspect ID`` (a message id without its
#: consumer) finds its rows by index rather than by reading the whole table.
SCHEMA_VERSION = 2

#: ``Index.info`` key of the version an index arrived in (see idemq.stores.sql.versions).
SINCE = "idemq_since"

# MariaDB and MySQL 8 spell "binary, no padding" differently.
MARIADB_KEY_COLLATION = "utf8mb4_nopad_bin"
MYSQL_KEY_COLLATION = "utf8mb4_0900_bin"


class UtcDateTime(TypeDecorator[datetime]):
    """Stored as a naive UTC ``DATETIME`` (the seed's type), always read back as aware UTC."""

    impl = DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


class UtcNow(FunctionElement[datetime]):
    """``CURRENT_TIMESTAMP``, with MySQL's required precision for ``DATETIME(6)``."""

    type = DateTime()
    inherit_cache = True
    name = "utc_now"


@compiles(UtcNow)
def _now_default(element: UtcNow, compiler: Any, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP"


@compiles(UtcNow, "mysql")
@compiles(UtcNow, "mariadb")
def _now_mysql(element: UtcNow, compiler: Any, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP(6)"


def _plain_timestamp() -> Any:
    return DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def as_utc(value: datetime | str) -> datetime:
    """A naive-UTC datetime (or SQLite's text form of one) as an aware UTC datetime."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _key(length: int, collation: str | None) -> Any:
    if collation is None:
        return String(length)
    return String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation=collation), "mysql", "mariadb"
    )


def check_table_name(name: object, what: str = "table name") -> str:
    """``name`` if it is letters, digits and ``_`` (at most 50: PostgreSQL keeps 63 bytes of a
    name, and idemq derives index and dead-table names from it), else ConfigurationError.

    A table name is spliced into DDL and statements: a name like ``x; DROP TABLE t; --`` is
    refused here, for every entry point alike, rather than quoted somewhere and not elsewhere.
    """
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_TABLE_NAME_CHARS
        or not name.replace("_", "").isalnum()
        or not name.isascii()
    ):
        raise ConfigurationError(f"{what} must be letters, digits and '_' (1-50): {name!r}")
    return name


MAX_TABLE_NAME_CHARS = 50


def build_table(
    name: str = DEFAULT_TABLE,
    *,
    schema: str | None = None,
    metadata: MetaData | None = None,
    mysql_collation: str | None = MARIADB_KEY_COLLATION,
    plain_types: bool = False,
) -> Table:
    """The dedup table: the seed's columns plus consumer scope, payload hash, result and lease.

    ``plain_types``: timestamps as SQLAlchemy's own ``DateTime`` (the same DDL) rather than
    :class:`UtcDateTime`, so a migration tool renders them without importing idemq.
    """
    timestamp: Any = _plain_timestamp() if plain_types else UtcDateTime()
    return Table(
        check_table_name(name),
        metadata or MetaData(),
        Column("consumer", _key(128, mysql_collation), primary_key=True),
        Column("message_id", _key(128, mysql_collation), primary_key=True),
        Column("business_id", String(64)),
        # 0 = processing/unprocessed, 1 = processed (the seed's values)
        Column("status", SmallInteger, nullable=False, server_default=text("0")),
        Column("payload_hash", String(64)),  # sha256 hex of the first payload seen
        Column("result", Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")),
        Column("owner", String(32)),  # random token of the claim holder
        Column("lease_until_ms", BigInteger),  # epoch ms; NULL once processed
        Column("attempts", Integer, nullable=False, server_default=text("1")),
        Column("processed_time", timestamp),
        Column("created_time", timestamp, nullable=False, server_default=UtcNow()),
        # purge (status=1 AND processed_time < cutoff) and stuck-lease scans (status=0)
        Index(f"ix_{name}_status_time", "status", "processed_time", info={SINCE: 1}),
        # find: a message id under every consumer (the primary key leads with consumer)
        Index(f"ix_{name}_message_id", "message_id", info={SINCE: 2}),
        schema=schema,
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def ddl(dialect: Dialect, table: Table) -> str:
    """``CREATE TABLE`` and ``CREATE INDEX`` statements for a DBA, as one SQL script."""
    statements = [str(CreateTable(table).compile(dialect=dialect)).strip()]
    statements += [
        str(CreateIndex(index).compile(dialect=dialect)).strip() for index in table.indexes
    ]
    return ";\n\n".join(statements) + ";\n"


def collation_for(dialect: Dialect) -> str | None:
    """The binary NO PAD collation for this MySQL flavour (None elsewhere)."""
    if dialect.name not in ("mysql", "mariadb"):
        return None
    return MARIADB_KEY_COLLATION if getattr(dialect, "is_mariadb", False) else MYSQL_KEY_COLLATION
