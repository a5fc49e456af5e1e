"""What the business-row guards build their SQL from: names from configuration can never carry
SQL, the guard's own columns can never be set by a caller, and the fence refuses only an older
token. Compiled per dialect, without a database."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Integer, Uuid, column, select
from sqlalchemy.dialects import postgresql

from idemq.business._sql import (
    MAX_IDENTIFIER_LEN,
    bind_prefix,
    bind_type,
    check_columns,
    check_identifier,
    fence_accepts,
    table_clause,
)
from idemq.errors import ConfigurationError


@pytest.mark.parametrize("name", ["orders", "_x", "Order_2", "a" * MAX_IDENTIFIER_LEN])
def test_plain_identifiers_pass(name: str):
    assert check_identifier(name, "table name") == name


@pytest.mark.parametrize(
    "name",
    [
        "orders; DROP TABLE users",
        'orders"',
        "2fast",
        "or ders",
        "schema.table",  # only table_clause splits a schema off
        "",
        None,
        "é",
    ],
)
def test_anything_that_could_carry_sql_is_refused(name: object):
    with pytest.raises(ConfigurationError, match="plain SQL identifier"):
        check_identifier(name, "table name")


def test_a_name_postgresql_would_truncate_is_refused_not_truncated():
    with pytest.raises(ConfigurationError, match="longer than 63"):
        check_identifier("a" * (MAX_IDENTIFIER_LEN + 1), "column name")


def test_a_caller_may_not_set_a_column_the_guard_manages():
    check_columns(["amount", "note"], "values", reserved={"state", "version"})
    with pytest.raises(ConfigurationError, match="'state': that column is managed by the guard"):
        check_columns(["amount", "state"], "values", reserved={"state", "version"})


def test_a_table_may_name_its_schema_and_every_part_is_checked():
    orders = table_clause("shop.orders", "id", "state")
    assert orders.schema == "shop"
    assert orders.name == "orders"
    assert [c.name for c in orders.columns] == ["id", "state"]
    with pytest.raises(ConfigurationError, match="schema name"):
        table_clause("sh op.orders", "id")
    with pytest.raises(ConfigurationError, match="column name"):
        table_clause("orders", "id;")


def test_the_fence_accepts_a_never_fenced_row_and_an_equal_or_newer_token():
    where = fence_accepts(column("fence"), "b_fence")
    compiled = str(select(column("id")).where(where).compile(dialect=postgresql.dialect()))
    assert "fence IS NULL OR fence <= %(b_fence)s" in compiled


def test_bind_names_never_begin_a_columns_name():
    assert bind_prefix(["id", "state"]) == "b_"
    assert bind_prefix(["b_total", "state"]) == "_b_"
    assert bind_prefix(["b_x", "_b_y"]) == "__b_"


def test_a_keys_bind_type_is_inferred_from_its_python_type():
    assert isinstance(bind_type(uuid.uuid4()), Uuid)
    assert isinstance(bind_type(7), Integer)
    # Inferred once per type: the statement built for one key serves the next.
    assert bind_type(uuid.uuid4()) is bind_type(uuid.uuid4())
