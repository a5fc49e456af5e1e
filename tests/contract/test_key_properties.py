"""Property tests: any valid key round-trips unchanged through every SQL store; invalid ones are
refused before anything is written; hostile strings are data, never SQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import idemq
from idemq.guard.core import MAX_MESSAGE_ID_CHARS, validate_message_id
from tests.contract.conftest import dispose, make_store

# Every code point a key may hold: no NUL, no lone surrogates (neither is storable in UTF-8 /
# PostgreSQL); everything else, whitespace and combining marks included, is kept exactly.
KEY_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
VALID_KEYS = st.text(KEY_CHARS, min_size=1, max_size=MAX_MESSAGE_ID_CHARS)
HOSTILE = [
    "'; DROP TABLE message_idempotent; --",
    '" OR 1=1 --',
    "%(message_id)s",
    ":message_id",
    "?",
    "\\x27",
    "a' /*",
    "{}[]*?",
    "ORDER_1\r\nSET x=1",
    "\U0001d518\U0001d52b astral \U0001f680",
    " ",
]


@pytest.fixture(scope="module", params=["sqlite", "postgres", "mariadb"])
def sql_store_module(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    store = make_store(request.param, Path(tmp_path_factory.mktemp("keys")))
    yield store
    dispose(store)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=VALID_KEYS)
def test_valid_keys_round_trip_unchanged(sql_store_module: Any, key: str):
    guard = idemq.Idempotency(sql_store_module, consumer="props")
    first = guard.process(key, lambda tx: key)
    again = guard.process(key, lambda tx: "second run")
    assert first.status is idemq.Status.PROCESSED or first.status is idemq.Status.DUPLICATE
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == key
    assert sql_store_module.get(key, "props").message_id == key


@pytest.mark.parametrize("key", HOSTILE)
def test_hostile_keys_are_data(sql_store_module: Any, key: str):
    guard = idemq.Idempotency(sql_store_module, consumer="hostile")
    assert guard.process(key, lambda tx: "ok").status is idemq.Status.PROCESSED
    assert guard.process(key, lambda tx: "again").status is idemq.Status.DUPLICATE
    assert [r.message_id for r in sql_store_module.find(key) if r.consumer == "hostile"] == [key]


@given(
    bad=st.one_of(
        st.just(""),
        st.text(KEY_CHARS, min_size=MAX_MESSAGE_ID_CHARS + 1, max_size=300),
        st.text(KEY_CHARS, max_size=20).map(lambda s: s + "\x00"),
        st.integers(),
        st.none(),
        st.binary(min_size=1),
        st.lists(st.text()),
    )
)
def test_invalid_keys_are_refused(bad: object):
    with pytest.raises(idemq.InvalidMessageIdError):
        validate_message_id(bad)


@given(key=VALID_KEYS)
def test_validation_never_alters_a_valid_key(key: str):
    assert validate_message_id(key) is key
