"""StateMachine / versioned_update configuration and argument checks (no server needed).

Every check here fires before a statement is sent, so an in-memory SQLite connection is enough
to prove that nothing was written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, create_engine, text

from idemq.business.state_machine import StateMachine, TransitionResult
from idemq.business.versioned import versioned_update
from idemq.errors import ConfigurationError, InvalidInputError, UnknownEventError

STATES = ["PENDING_PAYMENT", "PAYMENT_FAILED", "PAID", "SHIPPED"]
TRANSITIONS = {
    "pay": (("PENDING_PAYMENT", "PAYMENT_FAILED"), "PAID"),
    "ship": ("PAID", "SHIPPED"),
}


def machine(**overrides: object) -> StateMachine:
    args: dict[str, object] = {
        "table": "orders",
        "key_column": "order_id",
        "state_column": "status",
        "states": STATES,
        "transitions": TRANSITIONS,
    }
    args.update(overrides)
    return StateMachine(**args)  # type: ignore[arg-type]


@pytest.fixture
def conn() -> Iterator[Connection]:
    engine = create_engine("sqlite://")
    with engine.begin() as c:
        c.execute(
            text(
                "CREATE TABLE orders (order_id TEXT PRIMARY KEY, status TEXT, "
                "version INTEGER, fence_token INTEGER, note TEXT)"
            )
        )
        c.execute(text("INSERT INTO orders VALUES ('o1', 'PENDING_PAYMENT', 0, NULL, NULL)"))
        yield c
    engine.dispose()


def row(conn: Connection) -> tuple[object, ...]:
    return tuple(conn.execute(text("SELECT status, version, note FROM orders")).one())


BAD_NAMES = ["orders; DROP TABLE x", "a b", "", "1abc", 'x"', "x-y", "a.b.c", "é", "x" * 64, None]


@pytest.mark.parametrize("bad", BAD_NAMES)
@pytest.mark.parametrize("arg", ["table", "key_column", "state_column", "fence_column"])
def test_bad_identifiers_are_refused_at_construction(arg: str, bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"identifier|longer"):
        machine(**{arg: bad})


def test_schema_qualified_table_is_accepted() -> None:
    assert machine(table="public.orders").table == "public.orders"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"states": []}, "non-empty"),
        ({"states": "PAID"}, "non-empty"),
        ({"states": ["A", "A"]}, "unique"),
        ({"states": ["A", 3]}, "strings"),
        ({"transitions": {}}, "at least one"),
        ({"transitions": {"pay": ("PENDING_PAYMENT", "NOPE")}}, "unknown state"),
        ({"transitions": {"pay": ("NOPE", "PAID")}}, "unknown state"),
        ({"transitions": {"pay": ((), "PAID")}}, "no source"),
        ({"transitions": {"pay": ("PAID", "PAID")}}, "target"),
        ({"transitions": {"pay": "PAID"}}, "pair"),
        ({"transitions": {"": ("PAID", "SHIPPED")}}, "event names"),
        ({"key_column": "status"}, "must differ"),
    ],
)
def test_bad_machine_definitions(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        machine(**overrides)


def test_multi_source_transition_is_normalised() -> None:
    edge = machine().transition("pay")
    assert edge.sources == ("PENDING_PAYMENT", "PAYMENT_FAILED")
    assert edge.target == "PAID"


def test_unknown_event_is_a_clear_value_error(conn: Connection) -> None:
    with pytest.raises(UnknownEventError, match="refund") as info:
        machine().apply(conn, "o1", "refund")
    assert isinstance(info.value, InvalidInputError)
    assert isinstance(info.value, ValueError)
    assert row(conn) == ("PENDING_PAYMENT", 0, None)


@pytest.mark.parametrize(
    "extra",
    [{"status": "SHIPPED"}, {"order_id": "o2"}, {"fence_token": 1}, {"bad col": 1}],
)
def test_extra_values_may_not_touch_managed_or_bad_columns(
    conn: Connection, extra: dict[str, object]
) -> None:
    with pytest.raises(ConfigurationError):
        machine().apply(conn, "o1", "pay", extra)
    assert row(conn) == ("PENDING_PAYMENT", 0, None)


@pytest.mark.parametrize("fence", [True, "5", 1.5])
def test_fence_must_be_an_int(conn: Connection, fence: object) -> None:
    with pytest.raises(InvalidInputError, match="fence"):
        machine().apply(conn, "o1", "pay", fence=fence)  # type: ignore[arg-type]
    assert row(conn) == ("PENDING_PAYMENT", 0, None)


def test_extra_values_are_bound_parameters(conn: Connection) -> None:
    hostile = "x'); DROP TABLE orders; --"
    assert machine().apply(conn, "o1", "pay", {"note": hostile}) is TransitionResult.APPLIED
    assert row(conn) == ("PAID", 0, hostile)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"table": "orders;"}, ConfigurationError),
        ({"key_column": "order id"}, ConfigurationError),
        ({"version_column": "order_id"}, ConfigurationError),
        ({"values": {"version": 5}}, ConfigurationError),
        ({"values": {"order_id": "o2"}}, ConfigurationError),
        ({"values": {"n-o-t-e": 1}}, ConfigurationError),
        ({"expected_version": "0"}, InvalidInputError),
        ({"expected_version": True}, InvalidInputError),
        ({"fence": 2.0}, InvalidInputError),
    ],
)
def test_versioned_update_argument_checks(
    conn: Connection, kwargs: dict[str, object], error: type[Exception]
) -> None:
    args: dict[str, object] = {
        "table": "orders",
        "key_column": "order_id",
        "key": "o1",
        "expected_version": 0,
        "values": {"note": "x"},
    }
    args.update(kwargs)
    with pytest.raises(error):
        versioned_update(conn, **args)  # type: ignore[arg-type]
    assert row(conn) == ("PENDING_PAYMENT", 0, None)


def test_transition_result_is_json_and_knows_success() -> None:
    assert json.dumps({"r": TransitionResult.ALREADY_APPLIED}) == '{"r": "ALREADY_APPLIED"}'
    assert TransitionResult.APPLIED.ok
    assert TransitionResult.ALREADY_APPLIED.ok
    assert not any(
        r.ok
        for r in (TransitionResult.REJECTED, TransitionResult.NOT_FOUND, TransitionResult.FENCED)
    )
