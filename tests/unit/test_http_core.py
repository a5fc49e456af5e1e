"""The sans-I/O HTTP rules (idemq.integrations.http): key syntax, scoping, fingerprint, the
stored response and its header filter, problem bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from idemq import AsyncSqlStore, SqlStore
from idemq.errors import ConfigurationError, InvalidMessageError, InvalidMessageIdError
from idemq.guard.core import MAX_MESSAGE_ID_CHARS, validate_message_id
from idemq.integrations._inflight import LOCK_SPACE, lock_pauses, try_lock_sql
from idemq.integrations.asgi import IdempotencyKeyMiddleware
from idemq.integrations.http import (
    DEFAULT_STORED_STATUSES,
    MAX_KEY_CHARS,
    WHOLE_APP,
    Problem,
    StoredResponse,
    check_key,
    dedup_id,
    parse_key,
    request_fingerprint,
    scope_token,
    stored_statuses,
)

# -- the key: an RFC 8941 sf-string ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (b'  "abc"  ', "abc"),  # leading and trailing SP are discarded
        (b'"a\\"b\\\\c"', 'a"b\\c'),  # the two escapes
        (b'"with space ~!"', "with space ~!"),
        (b'"k";a=1;b="x";c=?1;d=tok/en;e=:aGk=:;f', "k"),  # parameters parsed, ignored
        (b'"k"; a=-1.5;b=@1700000000', "k"),
    ],
)
def test_parse_key_accepts_sf_strings(raw: bytes, key: str) -> None:
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"abc", "quoted string"),  # a token, not a String
        (b"", "quoted string"),
        (b'"abc', "closing quote"),
        (b'"a\\nb"', "escaped"),  # only \" and \\ may be escaped
        (b'"a\tb"', "printable ASCII"),
        (b'"caf\xc3\xa9"', "not ASCII"),
        (b'"a", "b"', "after the key"),  # two header lines joined by a comma
        (b'"a" x', "after the key"),
        (b'"a";A=1', "parameter"),  # parameter keys are lower case
        (b'"a";k=', "parameter value"),
    ],
)
def test_parse_key_refuses_what_is_not_an_sf_string(raw: bytes, why: str) -> None:
    with pytest.raises(InvalidMessageIdError, match=why):
        parse_key(raw)


def test_check_key_bounds() -> None:
    assert check_key("k" * MAX_KEY_CHARS, MAX_KEY_CHARS) == "k" * MAX_KEY_CHARS
    with pytest.raises(InvalidMessageIdError, match="maximum is 95"):
        check_key("k" * (MAX_KEY_CHARS + 1), MAX_KEY_CHARS)
    with pytest.raises(InvalidMessageIdError, match="empty"):
        check_key("", MAX_KEY_CHARS)


# -- the dedup id -----------------------------------------------------------------------------


def test_the_longest_key_in_any_scope_is_a_valid_message_id() -> None:
    key = "~" * MAX_KEY_CHARS
    for token in (WHOLE_APP, scope_token("Bearer abc")):
        message_id = dedup_id(token, key)
        assert validate_message_id(message_id) == message_id
        assert len(message_id) <= MAX_MESSAGE_ID_CHARS


def test_scopes_keep_equal_keys_apart_and_never_store_credentials() -> None:
    alice, bob = scope_token("Bearer alice"), scope_token(b"Bearer bob")
    assert alice != bob != WHOLE_APP
    assert scope_token("Bearer alice") == alice  # the same client finds its key again
    assert "alice" not in dedup_id(alice, "k")
    assert dedup_id(alice, "k") != dedup_id(bob, "k") != dedup_id(WHOLE_APP, "k")


def test_a_key_cannot_pose_as_another_scopes_key() -> None:
    # The token is "*" or 32 hex digits, so "<scope>:<key>" splits one way only.
    token = scope_token("x")
    forged = dedup_id(WHOLE_APP, f"{token}:k")
    assert forged != dedup_id(token, "k")


# -- the fingerprint --------------------------------------------------------------------------


def test_fingerprint_tells_requests_apart() -> None:
    base = request_fingerprint("POST", "/orders", b"", b'{"a":1}')
    assert base == request_fingerprint("POST", "/orders", b"", b'{"a":1}')
    others = {
        request_fingerprint("PATCH", "/orders", b"", b'{"a":1}'),
        request_fingerprint("POST", "/orders/2", b"", b'{"a":1}'),
        request_fingerprint("POST", "/orders", b"x=1", b'{"a":1}'),
        request_fingerprint("POST", "/orders", b"", b'{"a":2}'),
    }
    assert base not in others
    assert len(others) == 4


# -- stored responses -------------------------------------------------------------------------


def test_stored_response_keeps_what_describes_the_result() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Location", b"/orders/7"),
        (b"X-Order-Id", b"7"),
        (b"Connection", b"keep-alive, X-Conn-Only"),
        (b"X-Conn-Only", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"9"),
        (b"Date", b"Sun, 06 Dec 2026 13:00:00 GMT"),
        (b"Set-Cookie", b"session=secret"),
        (b"Upgrade", b"h2c"),
    ]
    stored = StoredResponse.of(201, headers, b'{"id": 7}')
    assert stored.headers == (
        (b"content-type", b"application/json"),
        (b"location", b"/orders/7"),
        (b"x-order-id", b"7"),
    )
    again = StoredResponse.from_result(json.loads(json.dumps(stored.to_result())))
    assert again == stored
    replay = dict(again.replay_headers())
    assert replay[b"idempotent-replayed"] == b"true"
    assert replay[b"content-length"] == b"9"


def test_binary_bodies_survive_the_store() -> None:
    body = bytes(range(256))
    stored = StoredResponse.of(200, [(b"content-type", b"application/octet-stream")], body)
    assert StoredResponse.from_result(json.loads(json.dumps(stored.to_result()))).body == body


@pytest.mark.parametrize(
    "result", [None, {"v": 2}, {"v": 1, "status": 200}, "text", {"paid": True}]
)
def test_a_result_that_is_not_a_stored_response_is_refused(result: object) -> None:
    with pytest.raises(InvalidMessageError, match="not a stored HTTP response"):
        StoredResponse.from_result(result)


def test_default_stored_statuses() -> None:
    assert {200, 201, 204, 303, 400, 404, 422} <= DEFAULT_STORED_STATUSES
    # A 5xx is not stored, nor a status that tells the client to try again.
    assert not {500, 502, 503, 408, 409, 425, 429, 304} & DEFAULT_STORED_STATUSES
    assert stored_statuses([200, 201]) == {200, 201}
    with pytest.raises(ConfigurationError, match="100-499"):
        stored_statuses([200, 500])


# -- problem details --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem", "status"),
    [
        (Problem.missing_key(), 400),
        (Problem.invalid_key("Idempotency-Key is empty"), 400),
        (Problem.in_flight(), 409),
        (Problem.reused(), 422),
        (Problem.request_too_large(10), 413),
        (Problem.response_too_large(10), 500),
        (Problem.store_unavailable(), 503),
    ],
)
def test_problem_bodies_follow_rfc_9457(problem: Problem, status: int) -> None:
    body = problem.body()
    document = json.loads(body)
    assert document["status"] == status
    assert document["type"] == "about:blank"
    assert all(document[name] for name in ("title", "detail", "code"))
    headers = dict(problem.headers(body))
    assert headers[b"content-type"] == b"application/problem+json"
    assert headers[b"content-length"] == str(len(body)).encode()
    typed = json.loads(problem.body("https://api.example/problems/"))
    assert typed["type"] == "https://api.example/problems/" + problem.code


# -- the middleware's settings ----------------------------------------------------------------


def test_middleware_settings_are_checked(tmp_path: Path) -> None:
    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not called")

    sync_store = SqlStore(f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(ConfigurationError, match="async store"):
        IdempotencyKeyMiddleware(app, store=sync_store)  # type: ignore[arg-type]
    sync_store.close()
    store = AsyncSqlStore(f"sqlite:///{tmp_path / 'a.db'}")
    for bad in ({"max_key_chars": 96}, {"max_key_chars": 0}, {"wait_s": -1}):
        with pytest.raises(ConfigurationError):
            IdempotencyKeyMiddleware(app, store=store, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="100-499"):
        IdempotencyKeyMiddleware(app, store=store, stored_statuses=[503])
    transactional = IdempotencyKeyMiddleware(app, store=store)
    assert transactional.owns_connection
    assert not IdempotencyKeyMiddleware(app, store=store, wait_s=None).owns_connection
    assert not IdempotencyKeyMiddleware(app, store=store, mode="lease").owns_connection


def test_the_in_flight_lock_is_one_per_key_in_a_space_of_its_own() -> None:
    statement = try_lock_sql("http", "*:order-1")
    assert statement == try_lock_sql("http", "*:order-1")  # every process finds the same lock
    assert statement.startswith(f"SELECT pg_try_advisory_xact_lock({LOCK_SPACE}, ")
    key = int(statement.rsplit(", ", 1)[1].rstrip(")"))
    assert -(2**31) <= key < 2**31  # the two-int form's second int
    assert statement != try_lock_sql("http", "*:order-2")
    assert statement != try_lock_sql("webhooks", "*:order-1")


def test_a_taken_lock_is_tried_again_backing_off_until_wait_s() -> None:
    clock = [100.0]

    def now() -> float:
        return clock[0]

    assert list(lock_pauses(0, now)) == []  # wait_s=0: a taken lock is a 409 at once
    pauses = []
    for pause_s in lock_pauses(1.0, now):
        pauses.append(pause_s)
        clock[0] += pause_s
    assert pauses[:3] == [0.01, 0.02, 0.04]
    assert max(pauses) == 0.25
    assert sum(pauses) == pytest.approx(1.0)
