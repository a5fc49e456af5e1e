"""The queries idemq runs on a dedup table of many rows go through an index (``EXPLAIN``).

A table of 200,000 rows over four consumers, analysed, is enough for the planners to choose as
they would at 10 M: a statement that scans the table here scans it there (``bench/big_table``
has the timings at scale).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.drivers.sql import DriverStatement
from idemq.stores.sql.dialects import plans_for
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

ROWS = 200_000

# One worker fills each backend's 200,000 rows once (the fixture is per module, so per worker).
pytestmark = pytest.mark.xdist_group("big_table")


@pytest.fixture(scope="module", params=["postgres", "mysql"])
def big_store(request: pytest.FixtureRequest) -> Iterator[idemq.SqlStore]:
    require_service(request.param)
    url = PG_URL if request.param == "postgres" else MYSQL_URL
    store = idemq.SqlStore(url, table=unique("big"))
    store.create_schema()
    table = store.table.name
    with store.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(
                f"INSERT INTO {table} (consumer, message_id, status, result, processed_time,"
                " created_time, attempts) SELECT 'c' || mod(g, 4), 'FILL_' || g, 1, '1',"
                f" now() - mod(g, 1000) * interval '1 minute', now(), 1"
                f" FROM generate_series(1, {ROWS}) g"
            )
            conn.exec_driver_sql(f"ANALYZE {table}")
        else:
            conn.exec_driver_sql(
                f"INSERT INTO {table} (consumer, message_id, status, result, processed_time,"
                " created_time, attempts) SELECT CONCAT('c', MOD(seq, 4)), CONCAT('FILL_', seq),"
                " 1, '1', NOW() - INTERVAL MOD(seq, 1000) MINUTE, NOW(), 1"
                f" FROM seq_1_to_{ROWS}"
            )
            conn.exec_driver_sql(f"ANALYZE TABLE {table}")
    yield store
    store.drop_schema()
    store.close()


def _plan(store: idemq.SqlStore, statement: Any, params: dict[str, Any]) -> str:
    if isinstance(statement, DriverStatement):  # the per-message ones: their Core statement
        statement = statement.statement
    with store.engine.connect() as conn:
        compiled = statement.compile(dialect=conn.dialect)
        bound = {**compiled.params, **params}
        rows = conn.exec_driver_sql(f"EXPLAIN {compiled}", bound).all()
    return "\n".join(" ".join(str(v) for v in row) for row in rows)


def _scans(plan: str, dialect: str, table: str) -> bool:
    if dialect == "postgresql":
        return f"Seq Scan on {table}" in plan
    # MariaDB's EXPLAIN rows: id, select_type, table, type, ...; type ALL is a full scan.
    return any(f" {table} ALL " in f" {line} " for line in plan.splitlines())


def test_find_uses_the_primary_key_not_a_scan(big_store: idemq.SqlStore) -> None:
    """``idemq inspect ID`` looks an id up in every consumer: a walk of the distinct consumers
    and one key lookup each (it was a scan of the whole table: 4 s at 10 M rows)."""
    plans = plans_for(big_store.engine.dialect, big_store.table)
    plan = _plan(big_store, plans.find_stmt, {"b_message_id": "FILL_1234"})
    assert not _scans(plan, big_store.engine.dialect.name, big_store.table.name), plan
    found = big_store.find("FILL_1234")
    assert [(r.consumer, r.message_id) for r in found] == [("c2", "FILL_1234")]
    assert big_store.find("FILL_NONE") == []


@pytest.mark.parametrize(
    ("statement", "params"),
    [
        ("get_stmt", {"b_consumer": "c1", "b_message_id": "FILL_5"}),
        ("in_progress_stmt", {"b_limit": 100}),
        ("complete_stmt", {"b_consumer": "c1", "b_message_id": "FILL_5", "b_owner": "o"}),
        ("release_stmt", {"b_consumer": "c1", "b_message_id": "FILL_5", "b_owner": "o"}),
        ("renew_stmt", {"b_consumer": "c1", "b_message_id": "FILL_5", "b_owner": "o"}),
        ("purge_stmt", {"b_cutoff": datetime(2000, 1, 1), "b_limit": 1000}),
    ],
)
def test_per_message_and_operator_statements_use_an_index(
    big_store: idemq.SqlStore, statement: str, params: dict[str, Any]
) -> None:
    plans = plans_for(big_store.engine.dialect, big_store.table)
    plan = _plan(big_store, getattr(plans, statement), params)
    assert not _scans(plan, big_store.engine.dialect.name, big_store.table.name), plan


def test_lookups_stay_fast_on_a_big_table(big_store: idemq.SqlStore) -> None:
    """The guard on the filled table: a duplicate of an old id and a first delivery."""
    guard = idemq.Idempotency(big_store, consumer="c3")
    assert guard.process("FILL_7", lambda tx: 2).status is idemq.Status.DUPLICATE
    assert guard.process(unique("NEW"), lambda tx: 2).status is idemq.Status.PROCESSED
    with big_store.engine.connect() as conn:
        count = conn.execute(sa.text(f"SELECT COUNT(*) FROM {big_store.table.name}")).scalar()
    assert count == ROWS + 1
