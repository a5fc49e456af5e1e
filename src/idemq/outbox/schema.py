"""The outbox tables, defined once for every SQL dialect, and adopting tables that exist.

``<table>`` holds the messages waiting to be published; ``<table>_dead`` the ones the relay gave
up on (with the reason), until ``idemq outbox retry ID`` moves them back.

``seq`` numbers rows in insertion order (an identity on PostgreSQL, ``AUTO_INCREMENT`` on
MySQL/MariaDB; on SQLite the INSERT itself takes ``MAX(seq) + 1``, safe because SQLite has one
writer at a time). The relay publishes rows of one ``ordering_key`` in ``seq`` order, each only
after every earlier row of its key was confirmed (see :mod:`idemq.outbox.relay`).

Indexes, each for the query named beside it, so neither the claim nor the cleanup scans:

* ``ux_<t>_seq`` (seq): unique; the key ``AUTO_INCREMENT`` needs;
* ``ix_<t>_pending`` (sent_ms, seq): the claim (``sent_ms IS NULL ORDER BY seq``) and the
  cleanup of sent rows (``sent_ms < cutoff``);
* ``ix_<t>_key`` (ordering_key, sent_ms, seq): "is there an earlier unsent row of my key?".
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Dialect,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    inspect,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from idemq.errors import ConfigurationError
from idemq.stores.sql.schema import check_table_name as check_name
from idemq.stores.sql.versions import creation_lock, record_version

__all__ = [
    "DEFAULT_TABLE",
    "OUTBOX_COLUMNS",
    "OUTBOX_SCHEMA_VERSION",
    "adopt_or_create",
    "build_dead_table",
    "build_outbox_table",
    "check_table_name",
    "ddl",
    "outbox_sql",
    "tables_for",
]

DEFAULT_TABLE = "idemq_outbox"

#: The outbox tables' schema version (recorded in idemq_schema_version, see
#: idemq.stores.sql.versions). 1: the tables as they first shipped.
OUTBOX_SCHEMA_VERSION = 1

# Keys compare exactly on every backend (see idemq.stores.sql.schema for why).
_MYSQL_BIN = {"mariadb": "utf8mb4_nopad_bin", "mysql": "utf8mb4_0900_bin"}

_AUTO_INCREMENT = "idemq_auto_increment"

OUTBOX_COLUMNS = (
    "id",
    "seq",
    "destination",
    "body",
    "headers",
    "ordering_key",
    "created_ms",
    "attempts",
    "next_attempt_ms",
    "last_error",
    "sent_ms",
    "lease_owner",
    "lease_until_ms",
)


@compiles(CreateColumn, "mysql")
@compiles(CreateColumn, "mariadb")
def _mysql_column(element: CreateColumn, compiler: Any, **kw: Any) -> str:
    # SQLAlchemy puts AUTO_INCREMENT on primary keys only; ``seq`` is not the primary key
    # (the message id is), so it is added here for the one column that asks for it.
    spec: str = compiler.visit_create_column(element, **kw)
    if element.element.info.get(_AUTO_INCREMENT):
        spec += " AUTO_INCREMENT"
    return spec


def check_table_name(table: str) -> str:
    """``table`` if it can name an outbox table (the rule of the dedup table's name)."""
    return check_name(table, "outbox table name")


def _key(length: int, flavor: str | None) -> Any:
    if flavor is None:
        return String(length)
    return String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation=_MYSQL_BIN[flavor]), "mysql", "mariadb"
    )


def _flavor(dialect: Dialect) -> str | None:
    if dialect.name not in ("mysql", "mariadb"):
        return None
    return "mariadb" if getattr(dialect, "is_mariadb", False) else "mysql"


def build_outbox_table(
    name: str = DEFAULT_TABLE, *, metadata: MetaData | None = None, flavor: str | None = "mariadb"
) -> Table:
    """The outbox table (``flavor``: the MySQL family member whose binary collation to use)."""
    return Table(
        name,
        metadata or MetaData(),
        Column("id", _key(128, flavor), primary_key=True),
        Column("seq", BigInteger, Identity(), nullable=False, info={_AUTO_INCREMENT: True}),
        Column("destination", String(255), nullable=False),
        Column("body", LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")),
        Column("headers", Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")),
        Column("ordering_key", _key(128, flavor)),
        Column("created_ms", BigInteger, nullable=False),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("next_attempt_ms", BigInteger, nullable=False),
        Column("last_error", Text),
        Column("sent_ms", BigInteger),
        # Only SQLite relays use these (elsewhere a claim is a row lock, SKIP LOCKED).
        Column("lease_owner", String(32)),
        Column("lease_until_ms", BigInteger),
        # A constraint, not an index: MySQL wants AUTO_INCREMENT's key inside CREATE TABLE.
        UniqueConstraint("seq", name=f"ux_{name}_seq"),
        Index(f"ix_{name}_pending", "sent_ms", "seq"),
        Index(f"ix_{name}_key", "ordering_key", "sent_ms", "seq"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mariadb_engine="InnoDB",
        mariadb_charset="utf8mb4",
    )


def build_dead_table(
    name: str = DEFAULT_TABLE, *, metadata: MetaData | None = None, flavor: str | None = "mariadb"
) -> Table:
    """``<name>_dead``: rows the relay gave up on, with the reason in ``last_error``."""
    return Table(
        f"{name}_dead",
        metadata or MetaData(),
        Column("id", _key(128, flavor), primary_key=True),
        Column("destination", String(255), nullable=False),
        Column("body", LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")),
        Column("headers", Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")),
        Column("ordering_key", _key(128, flavor)),
        Column("created_ms", BigInteger, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("last_error", Text),
        Column("dead_ms", BigInteger, nullable=False),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mariadb_engine="InnoDB",
        mariadb_charset="utf8mb4",
    )


def tables_for(dialect: Dialect, name: str) -> list[Table]:
    """The outbox and dead-letter tables as this dialect gets them."""
    metadata = MetaData()
    flavor = _flavor(dialect)
    return [
        build_outbox_table(name, metadata=metadata, flavor=flavor),
        build_dead_table(name, metadata=metadata, flavor=flavor),
    ]


def adopt_or_create(conn: Connection, name: str) -> None:
    """Create what is missing (tables, then indexes of tables that exist); use what is there.

    A table someone else made is kept as it is when it has our columns, and refused with one
    error naming the missing ones when it does not. A table created here has its schema version
    recorded. Creations in one database run one at a time (``creation_lock``): relays started
    together on a fresh database would otherwise all create the tables, and all but one fail.
    """
    with creation_lock(conn, None):
        inspector = inspect(conn)
        for table in tables_for(conn.dialect, name):
            if not inspector.has_table(table.name):
                table.create(conn)
                record_version(conn, table.name, "outbox", OUTBOX_SCHEMA_VERSION)
                continue
            have = {column["name"] for column in inspector.get_columns(table.name)}
            missing = [column.name for column in table.columns if column.name not in have]
            if missing:
                raise ConfigurationError(
                    f"table {table.name!r} exists without the outbox columns {missing}"
                )
            indexed = {index["name"] for index in inspector.get_indexes(table.name)}
            for index in table.indexes:
                if index.name not in indexed:
                    index.create(conn)


def ddl(dialect: Dialect, name: str = DEFAULT_TABLE) -> str:
    """``CREATE TABLE`` / ``CREATE INDEX`` of both outbox tables for a DBA, as one script."""
    statements: list[str] = []
    for table in tables_for(dialect, name):
        statements.append(str(CreateTable(table).compile(dialect=dialect)).strip())
        statements += [
            str(CreateIndex(index).compile(dialect=dialect)).strip() for index in table.indexes
        ]
    return ";\n\n".join(statements) + ";\n"


def outbox_sql(dialect: str, *, table: str = DEFAULT_TABLE) -> str:
    """:func:`ddl` for a dialect named ``postgresql``, ``mysql``, ``mariadb`` or ``sqlite``."""
    if dialect not in ("postgresql", "mysql", "mariadb", "sqlite"):
        raise ConfigurationError(f"unknown dialect {dialect!r}")
    return ddl(make_url(f"{dialect}://").get_dialect()(), check_table_name(table))
