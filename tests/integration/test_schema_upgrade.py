"""``idemq schema upgrade`` on a schema-version-1 table, while guards keep working on it.

Each backend: the version-1 DDL (``schema_v1/``, printed by idemq 0.1.0's ``idemq schema``),
100,000 rows, then the upgrade through the CLI while two threads (a transactional guard and a
lease-mode guard) process messages and their duplicates against the table. Afterwards every old
row is there, every new message's effect is there once, the guard claims, replays duplicates
and purges on the upgraded table, and a second upgrade finds nothing to do.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.cli import main
from idemq.errors import ConfigurationError
from idemq.migrations import plan_upgrade, upgrade_schema
from idemq.stores.sql.schema import SCHEMA_VERSION
from idemq.stores.sql.versions import VERSION_TABLE, recorded_version
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique, wait_until

OLD_DDL = Path(__file__).parent / "schema_v1"
OLD_ROWS = 100_000
# A writer never waits longer than this for the upgrade (an ALTER that copied or locked the
# table would hold 100k rows' worth of writers up).
MAX_STALL_S = 3.0


@pytest.fixture(params=["sqlite", "postgres", "mariadb"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'upgrade.db'}"
    require_service("postgres" if request.param == "postgres" else "mysql")
    return PG_URL if request.param == "postgres" else MYSQL_URL


def ddl_file(engine: sa.Engine) -> Path:
    name = {"postgresql": "postgresql", "sqlite": "sqlite"}.get(engine.dialect.name, "mariadb")
    return OLD_DDL / f"{name}.sql"


def create_v1_table(engine: sa.Engine, name: str) -> None:
    script = ddl_file(engine).read_text().replace("message_idempotent", name)
    with engine.begin() as conn:
        for statement in script.split(";\n"):
            if statement.strip():
                conn.exec_driver_sql(statement)


def fill(engine: sa.Engine, table: sa.Table, rows: int) -> None:
    """``rows`` processed records of consumer ``old``; the even ones 30 days old (purgeable)."""
    now = datetime.now(UTC).replace(tzinfo=None)
    old = now - timedelta(days=30)
    chunk = 10_000
    with engine.begin() as conn:
        for start in range(0, rows, chunk):
            conn.execute(
                table.insert(),
                [
                    {
                        "consumer": "old",
                        "message_id": f"OLD_{i:06d}",
                        "business_id": f"b{i}",
                        "status": 1,
                        "payload_hash": "0" * 64,
                        "result": '"ok"',
                        "attempts": 1,
                        "processed_time": old if i % 2 == 0 else now,
                        "created_time": old if i % 2 == 0 else now,
                    }
                    for i in range(start, min(start + chunk, rows))
                ],
            )


def effects_table(name: str) -> sa.Table:
    # No unique constraint: only the guard stands between a duplicate and a second row.
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(128), nullable=False),
    )


class Worker(threading.Thread):
    """Delivers LIVE ids twice each (the second a duplicate) until stopped; notes when each
    delivery finished, so a stall (a writer blocked by the upgrade) shows as a gap."""

    def __init__(self, store: idemq.SqlStore, effects: sa.Table, mode: str) -> None:
        super().__init__(daemon=True)
        self.guard = idemq.Idempotency(store, consumer=f"live-{mode}", mode=mode)
        self.effects, self.mode = effects, mode
        self.stop = threading.Event()
        self.done: list[float] = []
        self.outcomes: list[tuple[str, idemq.Status]] = []
        self.error: BaseException | None = None

    def effect(self, message_id: str) -> Any:
        def handler(tx: Any) -> str:
            tx.execute(self.effects.insert().values(message_id=message_id))
            return message_id

        return handler

    def run(self) -> None:
        n = 0
        try:
            while not self.stop.is_set():
                message_id = f"LIVE_{self.mode}_{n:06d}"
                for _ in range(2):
                    if self.mode == "lease":
                        # lease mode: the effect in its own transaction, the dedup row apart
                        out = self.guard.process(message_id, self.lease_effect(message_id))
                    else:
                        out = self.guard.process(message_id, self.effect(message_id))
                    self.outcomes.append((message_id, out.status))
                    self.done.append(time.monotonic())
                n += 1
        except BaseException as exc:
            self.error = exc

    def lease_effect(self, message_id: str) -> Any:
        engine = self.guard.store.engine

        def handler(_tx: Any) -> str:
            with engine.begin() as conn:
                conn.execute(self.effects.insert().values(message_id=message_id))
            return message_id

        return handler

    def longest_stall(self, start: float, end: float) -> float:
        inside = [t for t in self.done if start <= t <= end]
        edges = [start, *inside, end]
        return max(b - a for a, b in itertools.pairwise(edges))


def count(engine: sa.Engine, sql: str, **params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql), params).scalar_one())


@pytest.fixture
def old_table(url: str) -> Any:
    """A schema-version-1 dedup table with 100k rows, an effects table; dropped afterwards."""
    name = unique("up")
    store = idemq.SqlStore(url, table=name)
    create_v1_table(store.engine, name)
    fill(store.engine, store.table, OLD_ROWS)
    effects = effects_table(unique("fx"))
    effects.create(store.engine)
    yield store, effects
    effects.drop(store.engine)
    store.drop_schema()
    store.close()


def test_upgrade_of_a_version_1_table_loses_no_row_and_never_stalls_the_guards(
    old_table: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    store, effects = old_table
    name, engine = store.table.name, store.engine

    # What the upgrade reads there: no record, the columns and indexes of version 1.
    (plan,) = plan_upgrade(store, outbox_table=None)
    assert (plan.recorded, plan.found, plan.current) == (None, 1, SCHEMA_VERSION)
    assert any(f"ix_{name}_message_id" in statement for statement in plan.statements)

    assert main(["schema", "upgrade", "--store", str(store.url.render_as_string(False)),
                 "--table", name, "--no-outbox", "--dry-run"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert f"ix_{name}_message_id" in printed
    assert recorded_version_of(store) is None, "--dry-run changed nothing"
    assert f"ix_{name}_message_id" not in index_names(store)

    workers = [Worker(store, effects, "transactional"), Worker(store, effects, "lease")]
    for worker in workers:
        worker.start()
    wait_until(lambda: all(len(w.done) >= 20 for w in workers), "both writing before the upgrade")
    start = time.monotonic()
    code = main(["schema", "upgrade", "--store", store.url.render_as_string(False),
                 "--table", name, "--no-outbox"])  # fmt: skip
    end = time.monotonic()
    after = [len(w.done) for w in workers]
    wait_until(
        lambda: all(len(w.done) >= n + 20 for w, n in zip(workers, after, strict=True)),
        "both writing after the upgrade",
    )
    for worker in workers:
        worker.stop.set()
        worker.join(timeout=30)
    assert code == 0
    for worker in workers:
        assert worker.error is None, worker.error
        stall = worker.longest_stall(start, end)
        print(f"{engine.dialect.name} {worker.mode}: upgrade {end - start:.2f} s, "
              f"longest wait {stall:.2f} s, {len(worker.done)} deliveries")  # fmt: skip
        assert stall < MAX_STALL_S, f"{worker.mode} writer waited {stall:.2f} s"
        assert any(t > end for t in worker.done), f"{worker.mode} stopped writing"

    # Every version-1 row is still there, unchanged.
    assert count(engine, f"SELECT COUNT(*) FROM {name} WHERE consumer = 'old'") == OLD_ROWS
    assert count(engine, f"SELECT COUNT(*) FROM {name} WHERE consumer = 'old' AND status = 1 "
                 "AND result = '\"ok\"' AND payload_hash = :h", h="0" * 64) == OLD_ROWS  # fmt: skip
    # Every live message's effect landed once, its duplicate replayed.
    for worker in workers:
        delivered = {message_id for message_id, _ in worker.outcomes}
        for message_id, status in worker.outcomes[1::2]:
            assert status is idemq.Status.DUPLICATE, (message_id, status)
        effects_once = count(
            engine,
            f"SELECT COUNT(DISTINCT message_id) FROM {effects.name} WHERE message_id LIKE :p",
            p=f"LIVE_{worker.mode}_%",
        )
        assert effects_once == len(delivered)
    assert count(engine, f"SELECT COUNT(*) FROM {effects.name}") == count(
        engine, f"SELECT COUNT(DISTINCT message_id) FROM {effects.name}"
    )

    # The table is at the current version, recorded, with the new index.
    assert recorded_version_of(store) == SCHEMA_VERSION
    assert f"ix_{name}_message_id" in index_names(store)
    (again,) = plan_upgrade(store, outbox_table=None)
    assert (again.found, again.recorded, again.statements) == (SCHEMA_VERSION, SCHEMA_VERSION, [])
    assert not again.needed
    assert main(["schema", "upgrade", "--store", store.url.render_as_string(False),
                 "--table", name, "--no-outbox"]) == 0  # fmt: skip

    # The guard on the upgraded table: a claim, a duplicate, find by id, purge.
    guard = idemq.Idempotency(store, consumer="after")
    effect = Worker(store, effects, "transactional").effect("AFTER_1")
    assert guard.process("AFTER_1", effect).status is idemq.Status.PROCESSED
    assert guard.process("AFTER_1", effect).status is idemq.Status.DUPLICATE
    assert guard.process("OLD_000002", effect).status is idemq.Status.PROCESSED  # other consumer
    assert count(engine, f"SELECT COUNT(*) FROM {effects.name} WHERE message_id = 'AFTER_1'") == 2
    assert {r.consumer for r in store.find("OLD_000002")} == {"old", "after"}
    old_guard = idemq.Idempotency(store, consumer="old")
    assert old_guard.process("OLD_000003", effect).status is idemq.Status.DUPLICATE
    assert store.purge(timedelta(days=7), batch_size=5000) == OLD_ROWS // 2
    assert count(engine, f"SELECT COUNT(*) FROM {name} WHERE consumer = 'old'") == OLD_ROWS // 2
    assert count(engine, f"SELECT COUNT(*) FROM {name} WHERE consumer = 'old' "
                 "AND created_time < :c", c=datetime.now(UTC).replace(tzinfo=None)
                 - timedelta(days=7)) == 0  # fmt: skip


def recorded_version_of(store: idemq.SqlStore) -> int | None:
    with store.engine.connect() as conn:
        return recorded_version(conn, store.table.name)


def index_names(store: idemq.SqlStore) -> set[str]:
    inspector = sa.inspect(store.engine)
    return {str(index["name"]) for index in inspector.get_indexes(store.table.name)}


def test_find_uses_the_new_index_after_the_upgrade(url: str) -> None:
    """Why version 2 exists: a message id without its consumer is found by index."""
    if url.startswith("sqlite"):
        pytest.skip("the plan is checked on the two servers")
    name = unique("up")
    store = idemq.SqlStore(url, table=name)
    try:
        create_v1_table(store.engine, name)
        fill(store.engine, store.table, 20_000)
        upgrade_schema(store, outbox_table=None)
        with store.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"ANALYZE {name}")
            else:
                conn.exec_driver_sql(f"ANALYZE TABLE {name}")
            rows = conn.exec_driver_sql(
                f"EXPLAIN SELECT * FROM {name} WHERE message_id = 'OLD_000042'"
            ).fetchall()
        assert f"ix_{name}_message_id" in " ".join(str(value) for row in rows for value in row)
    finally:
        store.drop_schema()
        store.close()


def test_a_table_made_from_the_current_ddl_is_adopted_without_a_record(url: str) -> None:
    """A DBA ran ``idemq schema``'s output: no record, read as the version it is."""
    name = unique("up")
    store = idemq.SqlStore(url, table=name)
    try:
        with store.engine.begin() as conn:
            store.ddl_table(conn.dialect).create(conn)
        (plan,) = plan_upgrade(store, outbox_table=None)
        assert (plan.recorded, plan.found, plan.statements) == (None, SCHEMA_VERSION, [])
        assert plan.needed  # only the record is missing
        upgrade_schema(store, outbox_table=None)
        assert recorded_version_of(store) == SCHEMA_VERSION
        assert not plan_upgrade(store, outbox_table=None)[0].needed
    finally:
        store.drop_schema()
        store.close()


def test_create_schema_records_the_version_and_drop_schema_forgets_it(url: str) -> None:
    name = unique("up")
    store = idemq.SqlStore(url, table=name)
    try:
        store.create_schema()
        store.create_schema()
        assert recorded_version_of(store) == SCHEMA_VERSION
        assert not plan_upgrade(store, outbox_table=None)[0].needed
    finally:
        store.drop_schema()
    assert recorded_version_of(store) is None
    store.close()


def test_a_table_that_is_not_idemqs_is_refused_and_nothing_is_changed(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The seed's table (no consumer, no lease columns): exit 2 naming what is missing."""
    name = unique("seed")
    store = idemq.SqlStore(url, table=name)
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {name} (message_id VARCHAR(128) PRIMARY KEY, business_id VARCHAR(64),"
            " status SMALLINT DEFAULT 0, processed_time TIMESTAMP NULL,"
            " created_time TIMESTAMP DEFAULT CURRENT_TIMESTAMP)"
        )
    try:
        with pytest.raises(ConfigurationError, match="consumer"):
            upgrade_schema(store, outbox_table=None)
        code = main(["schema", "upgrade", "--store", store.url.render_as_string(False),
                     "--table", name, "--no-outbox"])  # fmt: skip
        assert code == 2
        assert "consumer" in capsys.readouterr().err
        assert recorded_version_of(store) is None
    finally:
        store.drop_schema()
        store.close()


def test_a_missing_table_or_sqlite_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    assert main(["schema", "upgrade", "--store", f"sqlite:///{missing}"]) == 2
    assert not missing.exists(), "the upgrade created a database file"
    store = idemq.SqlStore(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        with pytest.raises(ConfigurationError, match="no table"):
            upgrade_schema(store)
    finally:
        store.close()


def test_an_interrupted_postgresql_build_is_rebuilt() -> None:
    """``CREATE INDEX CONCURRENTLY`` that failed leaves an INVALID index of the same name:
    the upgrade drops and rebuilds it rather than taking it for done."""
    require_service("postgres")
    name = unique("up")
    store = idemq.SqlStore(PG_URL, table=name)
    try:
        create_v1_table(store.engine, name)
        with store.engine.begin() as conn:
            conn.exec_driver_sql(
                f"INSERT INTO {name} (consumer, message_id) VALUES ('a', 'x'), ('b', 'x')"
            )
        autocommit = store.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        # a duplicate 'x': the unique build fails, leaving its index INVALID
        with autocommit as conn, pytest.raises(sa.exc.IntegrityError):
            conn.exec_driver_sql(
                f"CREATE UNIQUE INDEX CONCURRENTLY ix_{name}_message_id ON {name} (message_id)"
            )
        (plan,) = plan_upgrade(store, outbox_table=None)
        assert plan.found == 1
        assert plan.statements[0].startswith("DROP INDEX CONCURRENTLY")
        upgrade_schema(store, outbox_table=None)
        with store.engine.connect() as conn:
            valid = conn.execute(
                sa.text(
                    "SELECT indisvalid, indisunique FROM pg_index "
                    "WHERE indexrelid = to_regclass(:n)"
                ),
                {"n": f"ix_{name}_message_id"},
            ).one()
        assert tuple(valid) == (True, False)
    finally:
        store.drop_schema()
        store.close()


def test_the_outbox_tables_are_recorded_when_present(url: str) -> None:
    name, outbox_name = unique("up"), unique("ob")
    store = idemq.SqlStore(url, table=name)
    try:
        store.create_schema()
        assert [p.table for p in plan_upgrade(store, outbox_table=outbox_name)] == [name]
        outbox = idemq.Outbox(store, table=outbox_name)
        outbox.create_schema()
        plans = plan_upgrade(store, outbox_table=outbox_name)
        assert [(p.table, p.recorded, p.needed) for p in plans] == [
            (name, SCHEMA_VERSION, False),
            (outbox_name, 1, False),
            (f"{outbox_name}_dead", 1, False),
        ]
        outbox.drop_schema()
        with store.engine.connect() as conn:
            assert recorded_version(conn, outbox_name) is None
            assert sa.inspect(conn).has_table(VERSION_TABLE)
    finally:
        store.drop_schema()
        store.close()


def test_postgresql_writers_pass_an_upgrade_that_waits_for_an_open_transaction() -> None:
    """The upgrade waits for a transaction that wrote to the table; writers meanwhile go on.

    A plain ``CREATE INDEX`` would queue a SHARE lock behind the open transaction, and every
    new writer would queue behind it (here: the writer's 2 s lock_timeout fires).
    """
    require_service("postgres")
    name = unique("up")
    store = idemq.SqlStore(PG_URL, table=name)
    try:
        create_v1_table(store.engine, name)
        fill(store.engine, store.table, 1000)
        holder = store.engine.connect()
        holder.exec_driver_sql(f"INSERT INTO {name} (consumer, message_id) VALUES ('t1', 'open')")
        errors: list[BaseException] = []

        def upgrade() -> None:
            try:
                upgrade_schema(store, outbox_table=None)
            except BaseException as exc:
                errors.append(exc)

        upgrader = threading.Thread(target=upgrade)
        upgrader.start()
        try:
            time.sleep(1.0)
            assert upgrader.is_alive(), "the upgrade did not wait for the open transaction"
            with store.engine.begin() as conn:
                conn.exec_driver_sql("SET LOCAL lock_timeout = '2s'")
                for i in range(20):
                    conn.exec_driver_sql(
                        f"INSERT INTO {name} (consumer, message_id) VALUES ('w', 'm{i}')"
                    )
            guard = idemq.Idempotency(store, consumer="during")
            assert guard.process("DURING_1", lambda tx: 1).status is idemq.Status.PROCESSED
        finally:
            holder.commit()
            holder.close()
            upgrader.join(timeout=60)
        assert not errors, errors
        assert recorded_version_of(store) == SCHEMA_VERSION
        assert count(store.engine, f"SELECT COUNT(*) FROM {name}") == 1000 + 1 + 20 + 1
    finally:
        store.drop_schema()
        store.close()


def test_create_schema_on_an_older_table_says_how_to_upgrade_it(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique("up")
    store = idemq.SqlStore(url, table=name)
    try:
        create_v1_table(store.engine, name)
        with caplog.at_level(logging.WARNING, logger="idemq.store"):
            store.create_schema()
        assert "schema version 1" in caplog.text
        assert "idemq schema upgrade" in caplog.text
        assert recorded_version_of(store) is None, "create_schema does not upgrade"
        upgrade_schema(store, outbox_table=None)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="idemq.store"):
            store.create_schema()
        assert caplog.text == ""
    finally:
        store.drop_schema()
        store.close()
