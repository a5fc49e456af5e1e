"""The app's migration: idemq's own DDL, run on the connection Django migrates.

The tables are exactly those :meth:`idemq.SqlStore.create_schema` and
:meth:`idemq.Outbox.create_schema` make (the same SQLAlchemy table definitions, compiled for
the database's dialect: MariaDB's and MySQL's key collations differ), each recorded in
``idemq_schema_version``, so ``idemq stats``, ``purge`` and ``schema upgrade`` take them as
their own. A table that already exists (made by ``create_schema`` before the project adopted
the app) is left as it is, as ``create_schema`` leaves it. No Django model stands for them:
``makemigrations`` has nothing to add.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateIndex, CreateTable

from idemq._clock import system_clock_ms
from idemq.errors import ConfigurationError
from idemq.outbox.schema import DEFAULT_TABLE as DEFAULT_OUTBOX_TABLE
from idemq.outbox.schema import OUTBOX_SCHEMA_VERSION, tables_for
from idemq.stores.sql.schema import DEFAULT_TABLE, SCHEMA_VERSION, build_table, collation_for
from idemq.stores.sql.versions import VERSION_TABLE, build_version_table

__all__ = ["configured_tables", "create_tables", "dialect_of", "drop_tables", "idemq_tables"]


def configured_tables() -> tuple[str, str]:
    """The dedup and outbox table names of the project: the settings ``IDEMQ_TABLE`` and
    ``IDEMQ_OUTBOX_TABLE`` (its dead letters are ``<name>_dead``), else idemq's own defaults.

    Read when the migration runs and when a :class:`DjangoStore` is made without ``table=``,
    so the two meet on one table. Set them before the first ``migrate``: a later change makes
    no table of the new name and renames none."""
    from django.conf import settings  # noqa: PLC0415 -- needs configured settings

    names = (
        getattr(settings, "IDEMQ_TABLE", DEFAULT_TABLE),
        getattr(settings, "IDEMQ_OUTBOX_TABLE", DEFAULT_OUTBOX_TABLE),
    )
    for setting, name in zip(("IDEMQ_TABLE", "IDEMQ_OUTBOX_TABLE"), names, strict=True):
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{setting} must be a non-empty table name, got {name!r}")
    return names


def dialect_of(connection: Any) -> sa.Dialect:
    """The SQLAlchemy dialect of Django's ``connection`` (MariaDB told apart from MySQL by its
    version string: their binary key collations differ)."""
    vendor = connection.vendor
    if vendor in ("postgresql", "sqlite"):
        name = vendor
    elif vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT VERSION()")
            version = str(cursor.fetchone()[0])
        name = "mariadb" if "mariadb" in version.lower() else "mysql"
    else:
        raise ConfigurationError(
            f"idemq's tables are made on PostgreSQL, MySQL/MariaDB and SQLite, not {vendor!r}"
        )
    dialect: sa.Dialect = make_url(f"{name}://").get_dialect()()
    return dialect


def idemq_tables(dialect: sa.Dialect) -> list[tuple[sa.Table, str, int]]:
    """``(table, kind, version)`` of every table the app makes, in creation order, under the
    names of :func:`configured_tables`."""
    dedup_name, outbox_name = configured_tables()
    dedup = build_table(dedup_name, mysql_collation=collation_for(dialect))
    outbox = [(t, "outbox", OUTBOX_SCHEMA_VERSION) for t in tables_for(dialect, outbox_name)]
    return [(dedup, "dedup", SCHEMA_VERSION), *outbox]


def _execute(connection: Any, statements: list[Any], dialect: sa.Dialect) -> None:
    with connection.cursor() as cursor:
        for statement in statements:
            sql = str(statement.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
            cursor.execute(sql.strip())


def create_tables(apps: Any, schema_editor: Any) -> None:
    """``RunPython`` forwards: create each missing table and record its version."""
    connection = schema_editor.connection
    dialect = dialect_of(connection)
    versions = build_version_table()
    existing = set(connection.introspection.table_names())
    statements: list[Any] = []
    if VERSION_TABLE not in existing:
        statements.append(CreateTable(versions, if_not_exists=True))
    for table, kind, version in idemq_tables(dialect):
        if table.name in existing:
            continue  # made by create_schema before: used as it is, like create_schema does
        statements.append(CreateTable(table))
        statements += [CreateIndex(index) for index in table.indexes]
        statements.append(sa.delete(versions).where(versions.c.table_name == table.name))
        statements.append(
            sa.insert(versions).values(
                table_name=table.name, kind=kind, version=version, updated_ms=system_clock_ms()
            )
        )
    _execute(connection, statements, dialect)


def drop_tables(apps: Any, schema_editor: Any) -> None:
    """``RunPython`` backwards: drop the tables and their version records (the records of
    tables made by other means stay, and so does ``idemq_schema_version``)."""
    connection = schema_editor.connection
    dialect = dialect_of(connection)
    versions = build_version_table()
    existing = set(connection.introspection.table_names())
    statements: list[Any] = []
    for table, _kind, _version in reversed(idemq_tables(dialect)):
        if table.name in existing:
            statements.append(sa.schema.DropTable(table))
        if VERSION_TABLE in existing:
            statements.append(sa.delete(versions).where(versions.c.table_name == table.name))
    _execute(connection, statements, dialect)
