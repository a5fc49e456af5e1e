"""The relay's claim and the cleanup use an index on a big outbox (PostgreSQL, MariaDB).

300,000 rows — 299,000 sent rows kept for audit, 1,000 pending over 50 keys — then the planner's
statistics (ANALYZE) and EXPLAIN of the very statements the relay runs: no full scan of the
outbox anywhere in the plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from tests.conftest import MYSQL_URL, PG_URL, require_service, unique

ROWS, PENDING = 300_000, 1_000
NOW_MS = 1_800_000_000_000


@pytest.fixture(params=["postgres", "mysql"])
def big_outbox(request: pytest.FixtureRequest) -> Iterator[idemq.Outbox]:
    require_service(request.param)
    store = idemq.SqlStore(PG_URL if request.param == "postgres" else MYSQL_URL)
    box = idemq.Outbox(store, table=unique("obx"))
    box.create_schema()
    t = box.table
    sent = ROWS - PENDING
    with store.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            source, i = "generate_series(1, :rows) AS g(i)", "i"
            ident = "'M' || i"
            key = "'k' || (i % 50)"
        else:
            source, i = "seq_1_to_300000 AS s", "s.seq"
            ident = "CONCAT('M', s.seq)"
            key = "CONCAT('k', s.seq % 50)"
        conn.execute(
            sa.text(
                f"INSERT INTO {t} (id, destination, body, headers, ordering_key, created_ms,"
                f" attempts, next_attempt_ms, sent_ms) SELECT {ident}, 'q', NULL, NULL, {key},"
                f" :now - 1000000 + {i}, 0, :now - 1000000 + {i},"
                f" CASE WHEN {i} <= :sent THEN :now - 1000000 + {i} ELSE NULL END FROM {source}"
            ),
            {"rows": ROWS, "now": NOW_MS, "sent": sent},
        )
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(
            sa.text(f"ANALYZE {t}" if conn.dialect.name == "postgresql" else f"ANALYZE TABLE {t}")
        )
    yield box
    box.drop_schema()
    store.close()


def _plan(conn: sa.Connection, statement: sa.TextClause, params: dict[str, Any]) -> list[Any]:
    if conn.dialect.name == "postgresql":
        return [row[0] for row in conn.execute(sa.text("EXPLAIN " + statement.text), params)]
    return [
        dict(row._mapping) for row in conn.execute(sa.text("EXPLAIN " + statement.text), params)
    ]


def _assert_indexed(dialect: str, table: str, plan: list[Any]) -> None:
    if dialect == "postgresql":
        text = "\n".join(plan)
        assert f"Seq Scan on {table}" not in text, text
        assert "Index" in text, text
        return
    for row in plan:
        assert row["type"] != "ALL", plan
        if row["table"] in ("o", "p", table):
            assert row["key"] is not None, plan


def test_claim_and_cleanup_use_an_index(big_outbox: idemq.Outbox) -> None:
    with big_outbox.engine.connect() as conn:
        sql = big_outbox.statements(conn.dialect)
        dialect = conn.dialect.name
        claim = _plan(conn, sql.claim.statement, {"now_ms": NOW_MS, "limit": 100})
        _assert_indexed(dialect, big_outbox.table, claim)
        # Rows come in index order and the LIMIT stops the scan: a backlog is never sorted.
        if dialect == "postgresql":
            assert not any("Sort" in line for line in claim), claim
        else:
            assert not any("filesort" in (row["Extra"] or "") for row in claim), claim
        cleanup = _plan(conn, sql.cleanup, {"cutoff_ms": NOW_MS - 500_000, "limit": 1000})
        _assert_indexed(dialect, big_outbox.table, cleanup)
