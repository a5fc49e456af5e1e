"""The app's migrations make the tables idemq's own ``create_schema`` makes, on every database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa

import idemq
from idemq.migrations import plan_upgrade
from idemq.outbox.schema import OUTBOX_SCHEMA_VERSION
from idemq.stores.sql.schema import SCHEMA_VERSION
from idemq.stores.sql.versions import recorded_version
from tests.conftest import unique
from tests.integration.django.conftest import manage, sa_url

TABLES = ["message_idempotent", "idemq_outbox", "idemq_outbox_dead"]


def _shape(inspector: Any, table: str) -> tuple[list[Any], list[Any], list[str]]:
    """Columns (name, type, nullable, has a default), index columns, primary key: what a table
    is, less its name (index names carry the table's)."""
    columns = [
        (c["name"], str(c["type"]).lower(), c["nullable"], c.get("default") is not None)
        for c in inspector.get_columns(table)
    ]
    indexes = sorted(
        (tuple(i["column_names"]), bool(i["unique"])) for i in inspector.get_indexes(table)
    )
    pk = inspector.get_pk_constraint(table)["constrained_columns"]
    return columns, indexes, pk


def test_migrate_makes_the_tables_create_schema_makes(
    alias: str, django_project: Any, stores: list[Any]
):
    url = sa_url(django_project, alias)
    twin = unique("twin")
    reference = idemq.SqlStore(url, table=twin)
    stores.append(reference)
    reference.create_schema()
    outbox = idemq.Outbox(reference, table=f"{twin}_ob")
    outbox.create_schema()
    try:
        inspector = sa.inspect(reference.engine)
        assert _shape(inspector, "message_idempotent") == _shape(inspector, twin)
        assert _shape(inspector, "idemq_outbox") == _shape(inspector, f"{twin}_ob")
        assert _shape(inspector, "idemq_outbox_dead") == _shape(inspector, f"{twin}_ob_dead")
        with reference.engine.connect() as conn:
            assert recorded_version(conn, "message_idempotent") == SCHEMA_VERSION
            assert recorded_version(conn, "idemq_outbox") == OUTBOX_SCHEMA_VERSION
            assert recorded_version(conn, "idemq_outbox_dead") == OUTBOX_SCHEMA_VERSION
    finally:
        reference.drop_schema()
        with reference.engine.begin() as conn:
            for name in (f"{twin}_ob_dead", f"{twin}_ob"):
                conn.execute(sa.text(f"DROP TABLE {name}"))


def test_idemq_takes_the_migrated_tables_as_its_own(
    alias: str, django_project: Any, stores: list[Any]
):
    store = idemq.SqlStore(sa_url(django_project, alias))
    stores.append(store)
    guard = idemq.Idempotency(store, consumer=unique("c"))
    assert guard.process("m-1", lambda tx: 1).status is idemq.Status.PROCESSED
    assert guard.process("m-1", lambda tx: 1).status is idemq.Status.DUPLICATE
    assert store.stats().processed >= 1
    # `idemq schema upgrade` finds nothing to do: the tables are at this idemq's version.
    assert [p.table for p in plan_upgrade(store) if p.needed] == []
    out = idemq.Outbox(store)
    with store.engine.begin() as conn:
        out.add(conn, "orders", b"{}")


def test_makemigrations_has_nothing_to_do(django_project: Any):
    done = manage(django_project, "sqlite", "makemigrations", "--check", "--dry-run", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No changes detected" in done.stdout


def test_the_migration_is_reversible(alias: str, django_project: Any):
    from django.core.management import call_command  # noqa: PLC0415
    from django.db import connections  # noqa: PLC0415

    introspection = connections[alias].introspection
    call_command("migrate", "idemq", "zero", database=alias, verbosity=0)
    try:
        assert not set(TABLES) & set(introspection.table_names())
    finally:
        call_command("migrate", "idemq", database=alias, verbosity=0)
    assert set(TABLES) <= set(introspection.table_names())


def test_migrate_makes_the_tables_the_settings_name(django_project: Any, tmp_path: Path):
    """``IDEMQ_TABLE`` / ``IDEMQ_OUTBOX_TABLE``: the migration makes and records tables of
    those names, and a ``DjangoStore()`` without ``table=`` guards on the dedup one."""
    databases = {"fresh": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "f.db")}}
    dedup, outbox = unique("dedup"), unique("outbox")
    names = {"IDEMQ_DJ_TABLE": dedup, "IDEMQ_DJ_OUTBOX_TABLE": outbox}
    manage(databases, "fresh", "migrate", "idemq", **names)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'f.db'}")
    try:
        tables = set(sa.inspect(engine).get_table_names())
        assert {dedup, outbox, f"{outbox}_dead"} <= tables
        assert not {"message_idempotent", "idemq_outbox"} & tables
        with engine.connect() as conn:
            assert recorded_version(conn, dedup) == SCHEMA_VERSION
            assert recorded_version(conn, outbox) == OUTBOX_SCHEMA_VERSION
        guarded = (
            "import idemq; from idemq.integrations.django import DjangoStore; "
            "g = idemq.Idempotency(DjangoStore(), consumer='c'); "
            "print(*(g.process('m-1', lambda tx: 1).status.name for _ in range(2)))"
        )
        done = manage(databases, "fresh", "shell", "-c", guarded, **names)
        last_line = done.stdout.strip().splitlines()[-1]  # after the shell's own notices
        assert last_line.split() == ["PROCESSED", "DUPLICATE"], done.stdout + done.stderr
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT message_id FROM {dedup}")).scalars().all()
        assert rows == ["m-1"]
    finally:
        engine.dispose()
