"""Three ``idemq schema upgrade`` at once on one old table: they serialise, and all exit 0.

Without a lock between them, the losers met each other's DDL: a deadlock between the
``CREATE INDEX CONCURRENTLY`` builds on PostgreSQL, a duplicate index name on MariaDB (exit 4).
To make the three meet every run, the test holds a transaction on the table that the index
build must wait for, and lets go once all three upgraders wait: on PostgreSQL one builds (its
index build waits on a lock) while the other two, connected, keep asking for the upgrade lock;
on MariaDB all three wait on a lock.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

import idemq
from idemq.stores.sql.schema import SCHEMA_VERSION
from tests.conftest import MYSQL_URL, PG_URL, server_wide, unique
from tests.integration.test_schema_upgrade import (
    create_v1_table,
    fill,
    index_names,
    recorded_version_of,
)

IDEMQ = str(Path(sys.executable).with_name("idemq"))
UPGRADERS = 3


def _waiting_upgraders(conn: sa.Connection, server: str, name: str) -> int:
    """How many upgraders wait: on PostgreSQL all of them once one's index build waits on a
    lock and every other one is connected (asking for the upgrade lock between pauses: the
    builder has two sessions, each waiter one); on MariaDB the sessions waiting on a lock."""
    if server == "postgres":
        counts = conn.execute(
            sa.text(
                "SELECT count(*), count(*) FILTER (WHERE state = 'active'"
                " AND wait_event_type = 'Lock') FROM pg_stat_activity"
                " WHERE application_name = :name"
            ),
            {"name": name},
        ).one()
        sessions, building = int(counts[0]), int(counts[1])
        return UPGRADERS if building >= 1 and sessions >= UPGRADERS + 1 else 0
    sql = (
        "SELECT count(*) FROM information_schema.processlist WHERE id <> connection_id()"
        " AND (info LIKE CONCAT('ALTER TABLE %', :name, '%') OR info LIKE '%GET_LOCK%')"
        " AND state LIKE '%lock%'"
    )
    return int(conn.execute(sa.text(sql), {"name": name}).scalar_one())


@pytest.mark.parametrize("server", ["postgres", "mysql"])
def test_concurrent_upgrades_serialise_and_all_succeed(server: str) -> None:
    # Alone on the server: upgrades take one lock per database, and another test's upgrade
    # that holds it while its index build waits for this test's open transaction (PostgreSQL's
    # CREATE INDEX CONCURRENTLY waits for every older transaction of the database) would keep
    # these upgraders from ever reaching their own build.
    server_wide(server)
    name = unique("up")
    base = PG_URL if server == "postgres" else MYSQL_URL
    # Tag the upgraders' sessions so the test can see them wait (PostgreSQL).
    url = f"{base}?application_name={name}" if server == "postgres" else base
    store = idemq.SqlStore(base, table=name)
    try:
        create_v1_table(store.engine, name)
        fill(store.engine, store.table, 20_000)
        command = [IDEMQ, "schema", "upgrade", "--store", url, "--table", name, "--no-outbox"]
        with store.engine.connect() as holder, store.engine.connect() as watcher:
            # An open transaction on the table: the index build waits for it (PostgreSQL: a
            # writer's lock; MariaDB: the metadata lock of a read).
            holder.execute(sa.select(store.table).limit(1).with_for_update()).all()
            upgraders = [
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(UPGRADERS)
            ]
            # MariaDB: under its 10 s lock_wait_timeout. PostgreSQL has none here; three
            # processes starting on a loaded machine take longer than 8 s to all connect.
            deadline = time.monotonic() + (8 if server == "mysql" else 45)
            while _waiting_upgraders(watcher, server, name) < UPGRADERS:
                assert all(p.poll() is None for p in upgraders), "an upgrader ended early"
                assert time.monotonic() < deadline, "the upgraders never all waited"
                watcher.rollback()
                time.sleep(0.05)
            holder.rollback()
        results = [(p.wait(timeout=120), p.communicate()[1]) for p in upgraders]
        assert [code for code, _ in results] == [0] * UPGRADERS, results
        # One of them built the index; the others found it built once they got their turn.
        upgraded = [err for _, err in results if f"upgraded {name}" in err]
        assert len(upgraded) == 1, results
        assert f"ix_{name}_message_id" in index_names(store)
        assert recorded_version_of(store) == SCHEMA_VERSION
    finally:
        store.drop_schema()
        store.close()
