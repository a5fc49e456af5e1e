"""Schema versions of idemq's tables, and bringing a table up to the current one in place.

The version of each table is recorded in ``idemq_schema_version`` (one row per table, keyed by
its name, in the same database schema as the table). A row of its own, rather than a comment on
the table or columns alone, because it:

* works the same on PostgreSQL, MariaDB/MySQL and SQLite (SQLite has no table comments);
* never alters the user's table to record anything (on MariaDB/MySQL a new table comment is an
  ``ALTER TABLE``, and PostgreSQL's ``COMMENT ON`` locks the table);
* is read with one primary-key lookup, and survives dumps and ``CREATE TABLE … LIKE``-style
  copies the same way the table does.

The row is a record, not the truth: a table without one (made from the printed DDL, by Alembic,
or by idemq 0.1.0) is read as the version its columns and indexes say, and an upgrade looks at
what is there before each step, so a stale or missing row never makes it skip or repeat work.

Each index carries the version it arrived in (``Index(..., info={SINCE: 2})``); an upgrade
builds the missing ones without blocking writes: ``CREATE INDEX CONCURRENTLY`` outside a
transaction on PostgreSQL (an invalid one left by an interrupted build is dropped and rebuilt),
``ALGORITHM=INPLACE, LOCK=NONE`` on MariaDB/MySQL (the server refuses rather than locks, and
``lock_wait_timeout`` bounds the wait for the brief metadata lock), a plain ``CREATE INDEX`` on
SQLite (one writer at a time: the build holds the write lock while it runs).

Upgrades of one database run one at a time (:func:`upgrade_lock`), and each plans only once it
holds the lock: two that planned together would both run the same DDL (a duplicate index name
on MariaDB, concurrent index builds deadlocking on PostgreSQL).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Dialect,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.schema import CreateTable

from idemq._backoff import Backoff
from idemq._clock import system_clock_ms
from idemq.drivers.sql import translated
from idemq.errors import ConfigurationError, StoreConflictError, StoreError
from idemq.stores.sql.schema import SINCE

__all__ = [
    "MYSQL_LOCK_WAIT_S",
    "SINCE",
    "VERSION_TABLE",
    "UPGRADE_LOCK_WAIT_S",
    "TableUpgrade",
    "build_version_table",
    "create_recorded",
    "creation_lock",
    "forget_version",
    "plan_upgrade",
    "recorded_version",
    "record_version",
    "run_upgrade",
    "upgrade_lock",
]

VERSION_TABLE = "idemq_schema_version"

#: How long a MariaDB/MySQL ``ALTER TABLE`` waits for the metadata lock before giving up
#: (while it waits, new statements on the table queue behind it).
MYSQL_LOCK_WAIT_S = 10

#: How long an upgrade waits for another one on the same database to finish before giving up.
UPGRADE_LOCK_WAIT_S = 600
_UPGRADE_LOCK_PAUSES = Backoff(first_s=0.05, max_s=1.0)  # between tries of the upgrade lock


def build_version_table(metadata: MetaData | None = None, *, schema: str | None = None) -> Table:
    """``idemq_schema_version``: ``table_name`` → ``kind`` (dedup, outbox), ``version``."""
    return Table(
        VERSION_TABLE,
        metadata or MetaData(),
        Column("table_name", String(128), primary_key=True),
        Column("kind", String(16), nullable=False),
        Column("version", Integer, nullable=False),
        Column("updated_ms", BigInteger, nullable=False),
        schema=schema,
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def since(index: Index) -> int:
    """The schema version ``index`` arrived in."""
    version: int = index.info.get(SINCE, 1)
    return version


def recorded_version(conn: Connection, name: str, schema: str | None = None) -> int | None:
    """The version recorded for table ``name``, None without a record."""
    if not sa.inspect(conn).has_table(VERSION_TABLE, schema=schema):
        return None
    versions = build_version_table(schema=schema)
    return conn.execute(
        sa.select(versions.c.version).where(versions.c.table_name == name)
    ).scalar_one_or_none()


def _ensure_version_table(conn: Connection, schema: str | None) -> Table:
    versions = build_version_table(schema=schema)
    if sa.inspect(conn).has_table(VERSION_TABLE, schema=schema):
        return versions
    if conn.dialect.name != "postgresql":
        # MariaDB/MySQL and SQLite create IF NOT EXISTS atomically.
        conn.execute(CreateTable(versions, if_not_exists=True))
        return versions
    # Two PostgreSQL sessions creating the same table at once: one fails on the catalog's
    # unique index even with IF NOT EXISTS; the loser finds the winner's table.
    savepoint = conn.begin_nested()
    try:
        with translated(f"create table {VERSION_TABLE}"):
            conn.execute(CreateTable(versions, if_not_exists=True))
    except StoreError:
        savepoint.rollback()
        if not sa.inspect(conn).has_table(VERSION_TABLE, schema=schema):
            raise
    else:
        savepoint.commit()
    return versions


def _upsert(dialect: Dialect, versions: Table, values: dict[str, Any]) -> Any:
    changed = {"kind": values["kind"], "version": values["version"]}
    changed["updated_ms"] = values["updated_ms"]
    if dialect.name == "postgresql":
        pg = postgresql.insert(versions).values(values)
        return pg.on_conflict_do_update(index_elements=["table_name"], set_=changed)
    if dialect.name == "sqlite":
        lite = sqlite.insert(versions).values(values)
        return lite.on_conflict_do_update(index_elements=["table_name"], set_=changed)
    my = mysql.insert(versions).values(values)
    return my.on_duplicate_key_update(changed)


def record_version(
    conn: Connection, name: str, kind: str, version: int, schema: str | None = None
) -> None:
    """Record that table ``name`` (a ``kind`` table) is at ``version`` (in ``conn``'s
    transaction; the version table is created if missing)."""
    versions = _ensure_version_table(conn, schema)
    values = {"table_name": name, "kind": kind, "version": version}
    values["updated_ms"] = system_clock_ms()
    conn.execute(_upsert(conn.dialect, versions, values))


def forget_version(conn: Connection, name: str, schema: str | None = None) -> None:
    """Remove the record of table ``name`` (its table was dropped)."""
    if sa.inspect(conn).has_table(VERSION_TABLE, schema=schema):
        versions = build_version_table(schema=schema)
        conn.execute(sa.delete(versions).where(versions.c.table_name == name))


def create_recorded(conn: Connection, table: Table, kind: str, version: int) -> bool:
    """Create ``table`` (and its indexes) if it is missing and record it at ``version``; a table
    that exists is left as it is (``idemq schema upgrade`` brings it up). True if created.

    Creations in one database run one at a time (:func:`creation_lock`), each looking for the
    table only once it holds the lock."""
    with creation_lock(conn, table.schema):
        if sa.inspect(conn).has_table(table.name, schema=table.schema):
            return False
        table.create(conn, checkfirst=True)
        record_version(conn, table.name, kind, version, table.schema)
        return True


@contextmanager
def creation_lock(conn: Connection, schema: str | None) -> Iterator[None]:
    """Workers started together on a fresh database all find the table missing and all create
    it: on PostgreSQL the losers fail on the catalog's unique index, on MariaDB/MySQL with "table
    already exists", and exit. So each creation holds a lock while it looks and creates.

    PostgreSQL: ``pg_advisory_xact_lock``, released when ``conn``'s transaction ends (after the
    version row is written). MariaDB/MySQL: ``GET_LOCK`` on ``conn``'s session (its DDL commits
    implicitly, so a transaction could not hold anything), released here. SQLite: one writer
    at a time already."""
    dialect = conn.dialect.name
    database = schema or conn.engine.url.database or ""
    digest = hashlib.sha256(f"idemq create {database}".encode()).digest()
    if dialect == "postgresql":
        key = int.from_bytes(digest[:8], "big", signed=True)
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
        yield
        return
    if dialect not in ("mysql", "mariadb"):
        yield
        return
    name = f"idemq_schema_create_{digest.hex()[:32]}"  # GET_LOCK names: 64 characters at most
    got = conn.execute(
        sa.text("SELECT GET_LOCK(:name, :wait_s)"), {"name": name, "wait_s": UPGRADE_LOCK_WAIT_S}
    ).scalar()
    if got != 1:
        raise StoreConflictError(
            f"another creation of idemq's tables in {database!r} still runs after"
            f" {UPGRADE_LOCK_WAIT_S} s"
        )
    try:
        yield
    finally:
        conn.execute(sa.text("SELECT RELEASE_LOCK(:name)"), {"name": name})


# -- upgrades -------------------------------------------------------------------------------


@dataclass
class TableUpgrade:
    """What an upgrade finds and does for one table.

    ``recorded``: the version in ``idemq_schema_version`` (None: no record); ``found``: the
    version the table's columns and indexes say; ``current``: this idemq's version;
    ``statements``: the DDL that brings it there, in order (empty: nothing to build).
    """

    table: str
    kind: str
    recorded: int | None
    found: int
    current: int
    statements: list[str] = field(default_factory=list)
    schema: str | None = None

    @property
    def needed(self) -> bool:
        """True when the upgrade has DDL to run or a record to write."""
        return bool(self.statements) or self.recorded != self.current


def _qualified(dialect: Dialect, table: Table) -> str:
    return dialect.identifier_preparer.format_table(table)


def _index_statements(conn: Connection, table: Table, index: Index, invalid: bool) -> list[str]:
    dialect = conn.dialect
    quote = dialect.identifier_preparer.quote
    columns = ", ".join(quote(column.name) for column in index.columns)
    name, target = quote(str(index.name)), _qualified(dialect, table)
    if dialect.name == "postgresql":
        statements = []
        if invalid:
            prefix = f"{quote(table.schema)}." if table.schema else ""
            statements.append(f"DROP INDEX CONCURRENTLY IF EXISTS {prefix}{name}")
        statements.append(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {target} ({columns})")
        return statements
    if dialect.name in ("mysql", "mariadb"):
        return [
            f"SET SESSION lock_wait_timeout = {MYSQL_LOCK_WAIT_S}",
            f"ALTER TABLE {target} ADD INDEX {name} ({columns}), ALGORITHM=INPLACE, LOCK=NONE",
        ]
    return [f"CREATE INDEX IF NOT EXISTS {name} ON {target} ({columns})"]


def _invalid_postgresql_indexes(conn: Connection, table: Table) -> set[str]:
    """Indexes of ``table`` an interrupted ``CREATE INDEX CONCURRENTLY`` left invalid."""
    rows = conn.execute(
        sa.text(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(:table) AND NOT i.indisvalid"
        ),
        {"table": _qualified(conn.dialect, table)},
    )
    return {row[0] for row in rows}


def plan_upgrade(conn: Connection, table: Table, kind: str, current: int) -> TableUpgrade:
    """Look at ``table`` as it is in the database and say what brings it to ``table``'s
    definition (version ``current``). ConfigurationError when it is missing or is not an idemq
    table (columns missing: nothing idemq released made it)."""
    inspector = sa.inspect(conn)
    if not inspector.has_table(table.name, schema=table.schema):
        raise ConfigurationError(
            f"there is no table {table.name!r} to upgrade (create it with idemq schema --store)"
        )
    have = {column["name"] for column in inspector.get_columns(table.name, schema=table.schema)}
    missing = [column.name for column in table.columns if column.name not in have]
    if missing:
        raise ConfigurationError(
            f"table {table.name!r} lacks the {kind} columns {missing}: not a table idemq made"
        )
    indexed = {index["name"] for index in inspector.get_indexes(table.name, schema=table.schema)}
    invalid = (
        _invalid_postgresql_indexes(conn, table) if conn.dialect.name == "postgresql" else set()
    )
    statements: list[str] = []
    found = current
    for index in sorted(table.indexes, key=lambda index: (since(index), str(index.name))):
        if index.name in indexed and index.name not in invalid:
            continue
        found = min(found, since(index) - 1)
        statements += _index_statements(conn, table, index, index.name in invalid)
    return TableUpgrade(
        table=table.name,
        kind=kind,
        recorded=recorded_version(conn, table.name, table.schema),
        found=max(found, 1),
        current=current,
        statements=statements,
        schema=table.schema,
    )


@contextmanager
def upgrade_lock(engine: Engine, schema: str | None = None) -> Iterator[None]:
    """Hold, on a connection of its own, the lock that lets one upgrade of ``engine``'s database
    run at a time; wait for it :data:`UPGRADE_LOCK_WAIT_S` at most
    (:class:`~idemq.StoreConflictError` after that: another upgrade is still running).

    PostgreSQL: a session-level ``pg_try_advisory_lock``, asked again and again outside any
    transaction until it is granted. Never a lock *waited* for inside a statement: a session
    blocked in ``pg_advisory_lock()`` or ``LOCK TABLE`` keeps a snapshot (the catalog's, at
    least) for as long as it waits, the holder's ``CREATE INDEX CONCURRENTLY`` waits for every
    snapshot older than its own, and neither wait is one the deadlock detector sees: three
    upgrades started together hung for ever. Between two tries a waiter holds nothing. The
    holder's own connection sits idle outside a transaction, so it holds no snapshot either.
    MariaDB/MySQL: ``GET_LOCK`` (server-wide, so its name carries the database). SQLite:
    nothing to do (its upgrade is one write transaction).
    """
    dialect = engine.dialect.name
    if dialect == "sqlite":
        yield
        return
    if dialect == "postgresql":
        database = schema or engine.url.database or ""
        hashed = hashlib.sha256(f"idemq upgrade {database}".encode()).digest()
        key = int.from_bytes(hashed[:8], "big", signed=True)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            deadline = time.monotonic() + UPGRADE_LOCK_WAIT_S
            attempt = 1
            while not conn.execute(
                sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": key}
            ).scalar():
                if time.monotonic() >= deadline:
                    raise StoreConflictError(
                        f"another schema upgrade of {database!r} still runs after"
                        f" {UPGRADE_LOCK_WAIT_S} s"
                    )
                time.sleep(_UPGRADE_LOCK_PAUSES.delay_s(attempt))
                attempt += 1
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        return
    database = schema or engine.url.database or ""
    digest = hashlib.sha256(database.encode()).hexdigest()[:32]
    name = f"idemq_schema_upgrade_{digest}"  # GET_LOCK names: 64 characters at most
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        got = conn.execute(
            sa.text("SELECT GET_LOCK(:name, :wait_s)"),
            {"name": name, "wait_s": UPGRADE_LOCK_WAIT_S},
        ).scalar()
        if got != 1:
            raise StoreConflictError(
                f"another schema upgrade of {database!r} still runs after {UPGRADE_LOCK_WAIT_S} s"
            )
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT RELEASE_LOCK(:name)"), {"name": name})


def run_upgrade(engine: Engine, upgrade: TableUpgrade) -> None:
    """Run ``upgrade``'s statements, then record its table at the current version.

    On PostgreSQL and MariaDB/MySQL each statement runs on its own, outside a transaction
    (``CONCURRENTLY`` requires it; MySQL commits DDL anyway); on SQLite in one transaction.
    Safe to run again after an interruption: the next plan sees what was built.
    """
    if engine.dialect.name == "sqlite":
        with engine.begin() as conn:
            for statement in upgrade.statements:
                conn.exec_driver_sql(statement)
            record_version(conn, upgrade.table, upgrade.kind, upgrade.current, upgrade.schema)
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in upgrade.statements:
            conn.exec_driver_sql(statement)
    with engine.begin() as conn:
        record_version(conn, upgrade.table, upgrade.kind, upgrade.current, upgrade.schema)
