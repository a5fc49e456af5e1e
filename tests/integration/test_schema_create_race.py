"""Workers started together on a fresh database each create the dedup table: every one of them
must come up, whichever wins the creation (a deployment's replicas start at once)."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

import idemq
from idemq.stores import open_store
from idemq.stores.sql.versions import VERSION_TABLE
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

STARTERS = 4


@pytest.mark.parametrize("backend", ["postgres", "mysql"])
def test_concurrent_create_schema_on_a_fresh_table_all_succeed(backend: str):
    require_service(backend)
    server_sql_url = PG_URL if backend == "postgres" else MYSQL_URL
    for _ in range(3):  # the collision is likely, not certain, in any one round
        table = unique("race")
        stores = [open_store(server_sql_url, table=table) for _ in range(STARTERS)]
        for store in stores:  # connected first, so the creations, not the logins, overlap
            store.engine.connect().close()
        barrier = threading.Barrier(STARTERS)
        errors: list[BaseException] = []

        def start(store: object, barrier: threading.Barrier, errors: list[BaseException]) -> None:
            barrier.wait()
            try:
                store.create_schema()  # type: ignore[attr-defined]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(s, barrier, errors)) for s in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        try:
            assert errors == []
            with stores[0].engine.connect() as conn:
                assert sa.inspect(conn).has_table(table)
                recorded = conn.execute(
                    sa.text(f"SELECT COUNT(*) FROM {VERSION_TABLE} WHERE table_name = :t"),
                    {"t": table},
                ).scalar()
            assert recorded == 1
        finally:
            stores[0].drop_schema()
            for store in stores:
                store.close()


@pytest.mark.parametrize("backend", ["postgres", "mysql"])
def test_concurrent_outbox_create_schema_on_fresh_tables_all_succeed(backend: str):
    require_service(backend)
    url = PG_URL if backend == "postgres" else MYSQL_URL
    for _ in range(3):
        name = unique("obrace")
        stores = [idemq.SqlStore(url, table=f"{name}_d") for _ in range(STARTERS)]
        outboxes = [idemq.Outbox(store, table=name) for store in stores]
        for store in stores:
            store.engine.connect().close()
        barrier = threading.Barrier(STARTERS)
        errors: list[BaseException] = []

        def start(
            outbox: idemq.Outbox, barrier: threading.Barrier, errors: list[BaseException]
        ) -> None:
            barrier.wait()
            try:
                outbox.create_schema()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(o, barrier, errors)) for o in outboxes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        try:
            assert errors == []
            with stores[0].engine.connect() as conn:
                assert sa.inspect(conn).has_table(name)
        finally:
            outboxes[0].drop_schema()
            for store in stores:
                store.close()
