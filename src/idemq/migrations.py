"""idemq's tables for your migrations, and bringing tables of an older idemq up in place.

* :func:`schema_metadata` puts the dedup table, the outbox tables and ``idemq_schema_version``
  in a ``MetaData`` of yours, so ``alembic revision --autogenerate`` writes their migration;
* :func:`plan_upgrade` / :func:`upgrade_schema` are what ``idemq schema upgrade`` runs: the
  online DDL that brings each table to the current version, then the version recorded (see
  :mod:`idemq.stores.sql.versions` for how versions are recorded and read).
"""

from __future__ import annotations

from sqlalchemy import MetaData, inspect

from idemq.drivers.sql import translated
from idemq.errors import ConfigurationError
from idemq.outbox.schema import DEFAULT_TABLE as DEFAULT_OUTBOX_TABLE
from idemq.outbox.schema import (
    OUTBOX_SCHEMA_VERSION,
    build_dead_table,
    build_outbox_table,
    check_table_name,
    tables_for,
)
from idemq.stores.sql.schema import (
    DEFAULT_TABLE,
    MARIADB_KEY_COLLATION,
    MYSQL_KEY_COLLATION,
    SCHEMA_VERSION,
    build_table,
)
from idemq.stores.sql.store import SqlStore
from idemq.stores.sql.versions import (
    VERSION_TABLE,
    TableUpgrade,
    build_version_table,
    run_upgrade,
    upgrade_lock,
)
from idemq.stores.sql.versions import plan_upgrade as plan_table_upgrade

__all__ = ["TableUpgrade", "plan_upgrade", "schema_metadata", "upgrade_schema"]

_COLLATIONS = {"mariadb": MARIADB_KEY_COLLATION, "mysql": MYSQL_KEY_COLLATION}


def schema_metadata(
    metadata: MetaData | None = None,
    *,
    table: str = DEFAULT_TABLE,
    schema: str | None = None,
    outbox_table: str | None = DEFAULT_OUTBOX_TABLE,
    mysql_flavor: str = "mariadb",
) -> MetaData:
    """``metadata`` (a new ``MetaData`` if None) with idemq's tables added, for Alembic.

    The dedup table ``table`` (in database schema ``schema``), the outbox tables
    ``outbox_table`` and ``<outbox_table>_dead`` (``outbox_table=None``: none), and
    ``idemq_schema_version``, so a version recorded by ``idemq schema upgrade`` is not a table
    autogenerate would drop. ``mysql_flavor`` (``mariadb`` or ``mysql``) picks the binary key
    collation the tables get on that server (there, pass ``outbox_table=None``: the outbox's
    ``seq`` needs an ``AUTO_INCREMENT`` that only idemq's own DDL gives it; see
    docs/howto/stores/schema.md). Pass your ``target_metadata`` in ``env.py``::

        target_metadata = idemq.schema_metadata(Base.metadata)
    """
    if mysql_flavor not in _COLLATIONS:
        raise ConfigurationError(f"mysql_flavor must be 'mariadb' or 'mysql', got {mysql_flavor!r}")
    target = MetaData() if metadata is None else metadata
    planned = [(schema, table)]
    if outbox_table is not None:
        check_table_name(outbox_table)
        planned += [(None, outbox_table), (None, f"{outbox_table}_dead")]
    for where, name in planned:
        if _key(where, name) in target.tables:
            raise ConfigurationError(f"the MetaData already has a table {_key(where, name)!r}")
    build_table(
        table,
        schema=schema,
        metadata=target,
        mysql_collation=_COLLATIONS[mysql_flavor],
        plain_types=True,
    )
    if outbox_table is not None:
        build_outbox_table(outbox_table, metadata=target, flavor=mysql_flavor)
        build_dead_table(outbox_table, metadata=target, flavor=mysql_flavor)
    for where in {where for where, _ in planned}:
        if _key(where, VERSION_TABLE) not in target.tables:
            build_version_table(target, schema=where)
    return target


def _key(schema: str | None, name: str) -> str:
    return name if schema is None else f"{schema}.{name}"


def plan_upgrade(
    store: SqlStore, *, outbox_table: str | None = DEFAULT_OUTBOX_TABLE
) -> list[TableUpgrade]:
    """What brings ``store``'s dedup table (which must exist) and the outbox tables (when they
    exist; ``outbox_table=None``: not looked at) to the current schema version."""
    if not isinstance(store, SqlStore):
        raise ConfigurationError(f"schema upgrade is for SQL stores, not {type(store).__name__}")
    if outbox_table is not None:
        check_table_name(outbox_table)
    with translated(f"plan a schema upgrade of {store.where}"), store.engine.connect() as conn:
        dedup = store.ddl_table(conn.dialect)
        plans = [plan_table_upgrade(conn, dedup, "dedup", SCHEMA_VERSION)]
        if outbox_table is not None and inspect(conn).has_table(outbox_table):
            plans += [
                plan_table_upgrade(conn, table, "outbox", OUTBOX_SCHEMA_VERSION)
                for table in tables_for(conn.dialect, outbox_table)
            ]
        conn.rollback()
    return plans


def upgrade_schema(
    store: SqlStore, *, outbox_table: str | None = DEFAULT_OUTBOX_TABLE, dry_run: bool = False
) -> list[TableUpgrade]:
    """Bring the tables :func:`plan_upgrade` names to the current version in place (online
    DDL: writers keep going), recording each table's version; ``dry_run``: only plan. Safe to
    run twice: the second run finds nothing to build. Returns the plans."""
    if dry_run:
        return plan_upgrade(store, outbox_table=outbox_table)
    # Planned only once the lock is held: a plan made beside another upgrade would run the DDL
    # that upgrade is running (see upgrade_lock).
    with (
        translated(f"wait for other schema upgrades of {store.where}"),
        upgrade_lock(store.engine, store.table.schema),
    ):
        plans = plan_upgrade(store, outbox_table=outbox_table)
        for plan in plans:
            if plan.needed:
                with translated(f"upgrade table {plan.table} in {store.where}"):
                    run_upgrade(store.engine, plan)
    return plans
