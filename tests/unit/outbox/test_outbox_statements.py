"""The outbox's SQL per dialect, compiled without a database: what each dialect's relay relies
on (PostgreSQL's NOTIFY, SQLite's leases, MariaDB's duplicate-key insert) and names quoted."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Dialect

from idemq.drivers.sql import DriverStatement
from idemq.outbox.statements import statements_for


def text_of(statement: Any) -> str:
    """The SQL as written (a statement compiled once for the driver carries its ``text()``)."""
    return str(statement.statement if isinstance(statement, DriverStatement) else statement)


def sql(dialect: Dialect, table: str = "app_outbox") -> dict[str, str]:
    statements = statements_for(dialect, table)
    return {
        name: text_of(value)
        for name, value in vars(statements).items()
        if value is not None and not isinstance(value, bool | str)
    }


def test_postgresql_notifies_the_tables_channel_in_the_insert_and_locks_rows():
    statements = statements_for(postgresql.dialect(), "app_outbox")
    assert statements.channel == "app_outbox"
    assert not statements.lease
    assert statements.renew_leases is None  # row locks, not leases
    assert "pg_notify(:channel" in text_of(statements.insert)
    # A keyed row takes the key's advisory lock to commit: seq follows commit order per key.
    assert "pg_advisory_xact_lock" in text_of(statements.insert_keyed)
    assert "pg_advisory_xact_lock" not in text_of(statements.insert)
    assert "ON CONFLICT (id) DO NOTHING" in text_of(statements.insert)


def test_sqlite_claims_by_leases_fenced_by_owner():
    statements = statements_for(sqlite.dialect(), "app_outbox")
    assert statements.lease
    assert statements.channel == ""
    for fenced in (statements.renew_leases, statements.delete_leased):
        assert fenced is not None
        assert "lease_owner = :owner" in text_of(fenced)
    assert "lease_owner = :owner, lease_until_ms = :until_ms" in text_of(statements.claim)


def test_mariadb_inserts_plainly_and_has_no_channel_nor_leases():
    statements = statements_for(mysql.dialect(), "app_outbox")
    assert statements.channel == ""
    assert not statements.lease
    assert statements.lease_of is None
    # A duplicate id is error 1062 there, which the add turns into "already there".
    assert "ON CONFLICT" not in text_of(statements.insert)
    assert text_of(statements.insert) == text_of(statements.insert_keyed)


def test_every_statement_names_the_table_and_its_dead_table_quoted_by_the_dialect():
    for statement in sql(postgresql.dialect(), "Outbox").values():
        assert '"Outbox"' in statement or '"Outbox_dead"' in statement, statement
    for statement in sql(mysql.dialect(), "Outbox").values():
        assert "`Outbox`" in statement or "`Outbox_dead`" in statement, statement
