"""``idemq.schema_metadata`` in a real Alembic environment: autogenerate writes idemq's tables,
the migration creates them, the guard and the outbox work on them, and a second autogenerate
finds nothing to change (types, server defaults and indexes compared)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import PG_URL, require_service, unique

alembic = pytest.importorskip("alembic", reason="alembic is in the dev extra")
from alembic import command  # noqa: E402
from alembic.autogenerate import compare_metadata  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402

# env.py of the project under test: its own model plus idemq's tables. The database is shared
# with other tests, so only the tables of this MetaData are looked at (include_name).
ENV_PY = """
import sqlalchemy as sa
from alembic import context

import idemq

config = context.config
base = sa.MetaData()
sa.Table("{orders}", base, sa.Column("id", sa.Integer, primary_key=True))
target_metadata = idemq.schema_metadata(
    base, table="{table}", outbox_table="{outbox}"
)


def include_name(name, type_, parent_names):
    if type_ == "table":
        return name in {{t.name for t in target_metadata.tables.values()}}
    return True


engine = sa.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=sa.pool.NullPool)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_name=include_name,
        compare_type=True,
        compare_server_default={compare_defaults},
        version_table="{version_table}",
    )
    with context.begin_transaction():
        context.run_migrations()
"""


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'alembic.db'}"
    require_service("postgres")
    return PG_URL


def alembic_env(tmp_path: Path, url: str, names: dict[str, str]) -> Config:
    config = Config(str(tmp_path / "alembic.ini"))
    config.set_main_option("script_location", str(tmp_path / "migrations"))
    config.set_main_option("sqlalchemy.url", url)
    command.init(config, str(tmp_path / "migrations"))
    (tmp_path / "migrations" / "env.py").write_text(ENV_PY.format(**names))
    return config


def test_autogenerate_creates_idemqs_tables_and_then_has_nothing_to_change(
    url: str, tmp_path: Path
) -> None:
    names = {
        "orders": unique("orders"),
        "table": unique("mi"),
        "outbox": unique("ob"),
        "version_table": unique("alembic_version"),
        # SQLite has no identity columns: Alembic would report the outbox's seq Identity()
        # as a changed server default there, so SQLite keeps Alembic's default (off).
        "compare_defaults": str(not url.startswith("sqlite")),
    }
    config = alembic_env(tmp_path, url, names)
    engine = sa.create_engine(url)
    try:
        script = command.revision(config, message="idemq", autogenerate=True)
        assert script is not None
        assert not isinstance(script, list)
        migration = Path(str(script.path)).read_text()
        for name in (names["table"], names["outbox"], f"{names['outbox']}_dead"):
            assert f"op.create_table('{name}'" in migration, migration
        assert f"ix_{names['table']}_message_id" in migration
        assert "idemq." not in migration, "the migration must not need idemq to run"

        command.upgrade(config, "head")

        # Nothing left to change: types, server defaults and indexes all match.
        metadata = idemq.schema_metadata(
            sa.MetaData(), table=names["table"], outbox_table=names["outbox"]
        )
        sa.Table(names["orders"], metadata, sa.Column("id", sa.Integer, primary_key=True))
        ours = {t.name for t in metadata.tables.values()}

        def include_name(name: Any, type_: str, _parents: Any) -> bool:
            return type_ != "table" or name in ours

        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_name": include_name,
                    "compare_type": True,
                    "compare_server_default": not url.startswith("sqlite"),
                    "target_metadata": metadata,
                },
            )
            assert compare_metadata(context, metadata) == []
        second = command.revision(config, message="nothing", autogenerate=True)
        assert second is not None
        assert not isinstance(second, list)
        body = Path(str(second.path)).read_text()
        upgrade = body[body.index("def upgrade()") : body.index("def downgrade()")]
        assert "op." not in upgrade, upgrade

        # idemq works on the tables Alembic made: claims, duplicates, the outbox in the handler.
        store = idemq.SqlStore(url, table=names["table"])
        outbox = idemq.Outbox(store, table=names["outbox"])
        guard = idemq.Idempotency(store, consumer="alembic")
        orders = sa.Table(names["orders"], sa.MetaData(), autoload_with=engine)

        def handler(tx: Any) -> int:
            tx.execute(orders.insert().values(id=1))
            outbox.add(tx, "orders.paid", b"{}")
            return 1

        assert guard.process("ORDER_1", handler).status is idemq.Status.PROCESSED
        assert guard.process("ORDER_1", handler).status is idemq.Status.DUPLICATE
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar() == 1
            outbox_rows = conn.exec_driver_sql(f"SELECT COUNT(*) FROM {names['outbox']}")
            assert outbox_rows.scalar() == 1
        # an upgrade finds the Alembic-made tables at the current version
        plans = idemq.migrations.plan_upgrade(store, outbox_table=names["outbox"])
        assert [plan.statements for plan in plans] == [[], [], []]
        outbox.drop_schema()
        store.drop_schema()
        store.close()
    finally:
        # not a downgrade: on a shared database it could drop the shared idemq_schema_version
        with engine.begin() as conn:
            for name in (names["orders"], names["version_table"], names["table"]):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
            for name in (names["outbox"], f"{names['outbox']}_dead"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
        engine.dispose()


def test_schema_metadata_refuses_bad_input() -> None:
    with pytest.raises(idemq.ConfigurationError):
        idemq.schema_metadata(mysql_flavor="oracle")
    with pytest.raises(idemq.ConfigurationError):
        idemq.schema_metadata(table="x; DROP TABLE y")
    with pytest.raises(idemq.ConfigurationError):
        idemq.schema_metadata(outbox_table="bad name")
    metadata = idemq.schema_metadata()
    with pytest.raises(idemq.ConfigurationError, match="already"):
        idemq.schema_metadata(metadata)
    # two dedup tables share one version table
    idemq.schema_metadata(metadata, table="second", outbox_table=None)
    assert {"message_idempotent", "second", "idemq_schema_version"} <= set(metadata.tables)
