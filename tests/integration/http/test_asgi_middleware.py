"""IdempotencyKeyMiddleware on a real server (uvicorn), a real client (httpx) and real stores:
SQLite and PostgreSQL in transactional mode (the app writes through the dedup transaction),
Redis in lease mode (the effect is elsewhere)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.conftest import unique
from tests.integration.http.conftest import Server, serve

pytestmark = pytest.mark.timeout(180)


def key_header(key: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{key}"'}


def post(server: Server, key: str | None, body: dict[str, Any], **headers: str) -> httpx.Response:
    sent = {**headers, **(key_header(key) if key is not None else {})}
    with server.client() as client:
        return client.post("/orders", json=body, headers=sent)


def problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["status"] == status
    assert document["code"] == code
    assert all(document[name] for name in ("title", "detail"))


# -- on every store -------------------------------------------------------------------------


def test_first_request_runs_and_its_retry_is_replayed(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    first = post(server, key, {"ref": ref})
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert first.headers["set-cookie"] == "session=secret"  # the first response is the app's

    again = post(server, key, {"ref": ref})
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()  # the same run, not a second one
    assert server.effects(ref) == 1


def test_a_replay_keeps_the_headers_that_describe_the_result(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    post(server, key, {"ref": ref})
    again = post(server, key, {"ref": ref})
    assert again.headers["location"] == f"/orders/{ref}"
    assert again.headers["x-order-id"] == ref
    assert again.headers["content-type"] == "application/json"
    assert int(again.headers["content-length"]) == len(again.content)
    # hop-by-hop and the credential the first response set are not replayed
    assert again.headers.get("keep-alive") != "timeout=99"
    assert "set-cookie" not in again.headers


def test_same_key_with_another_request_is_422(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    assert post(server, key, {"ref": ref}).status_code == 201
    problem(post(server, key, {"ref": ref, "amount": 2}), 422, "idempotency-key-reused")
    with server.client() as client:  # another path with the same key and body
        other = client.post(f"/orders/{ref}", json={"ref": ref}, headers=key_header(key))
    problem(other, 422, "idempotency-key-reused")
    assert server.effects(ref) == 1


def test_a_retry_while_the_first_still_runs(server: Server) -> None:
    key, ref, gate = unique("k"), unique("order"), unique("gate")
    body = {"ref": ref, "gate": gate}
    answers: dict[str, httpx.Response] = {}
    first = threading.Thread(target=lambda: answers.update(first=post(server, key, body)))
    first.start()
    try:
        server.wait_started(gate)
        if server.kind == "sqlite":
            # SQLite's one writer: the retry waits at BEGIN for the first to commit, then
            # replays its response.
            retry = threading.Thread(target=lambda: answers.update(retry=post(server, key, body)))
            retry.start()
            server.open_gate(gate)
            retry.join(60)
            assert answers["retry"].headers["idempotent-replayed"] == "true"
        else:
            problem(post(server, key, body), 409, "idempotency-key-in-flight")
            if server.kind == "postgres":
                assert not left_in_transaction(server), "the 409's connection went back open"
    finally:
        server.open_gate(gate)
        first.join(60)
    assert answers["first"].status_code == 201
    after = post(server, key, body)
    assert after.headers["idempotent-replayed"] == "true"
    assert after.json() == answers["first"].json()
    assert server.effects(ref) == 1


def test_a_5xx_is_not_stored_and_the_retry_runs_once_more(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    body = {"ref": ref, "fail_times": 1}
    failed = post(server, key, body)
    assert failed.status_code == 500
    assert "idempotent-replayed" not in failed.headers
    # Transactional: the 500's write was rolled back with the dedup row. Lease: the effect is
    # elsewhere and was made; the claim was released so the retry runs (at least once).
    assert server.effects(ref) == (1 if server.kind == "redis" else 0)

    retried = post(server, key, body)
    assert retried.status_code == 201
    assert retried.json()["attempt"] == 2
    assert "idempotent-replayed" not in retried.headers
    assert server.effects(ref) == (2 if server.kind == "redis" else 1)

    replayed = post(server, key, body)
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.json() == retried.json()
    assert server.effects(ref) == (2 if server.kind == "redis" else 1)


def test_an_app_that_raises_leaves_nothing_and_its_retry_runs(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    body = {"ref": ref, "raise_times": 1}
    assert post(server, key, body).status_code == 500  # the server's own error page
    assert server.effects(ref) == (1 if server.kind == "redis" else 0)
    retried = post(server, key, body)
    assert retried.status_code == 201
    assert "idempotent-replayed" not in retried.headers
    assert server.effects(ref) == (2 if server.kind == "redis" else 1)


def test_a_streamed_response_is_stored_whole_and_replayed(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    with server.client() as client:
        first = client.post("/stream", json={"ref": ref}, headers=key_header(key))
        again = client.post("/stream", json={"ref": ref}, headers=key_header(key))
        plain = client.post("/stream", json={"ref": ref})  # unguarded: streamed as it comes
    assert first.status_code == again.status_code == plain.status_code == 201
    assert first.text == again.text == plain.text == f"first;second;{ref}"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"].startswith("text/plain")
    assert plain.headers["transfer-encoding"] == "chunked"
    assert server.effects(ref) == 2


def test_a_stored_4xx_is_replayed(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    body = {"ref": ref, "status": 402}
    assert post(server, key, body).status_code == 402
    again = post(server, key, body)
    assert again.status_code == 402
    assert again.headers["idempotent-replayed"] == "true"
    assert server.effects(ref) == 1


def test_keys_are_scoped_by_the_authorization_header(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    alice = post(server, key, {"ref": ref}, Authorization="Bearer alice")
    bob = post(server, key, {"ref": ref}, Authorization="Bearer bob")
    anonymous = post(server, key, {"ref": ref})
    assert {r.status_code for r in (alice, bob, anonymous)} == {201}
    assert len({r.json()["run"] for r in (alice, bob, anonymous)}) == 3
    assert server.effects(ref) == 3
    # each client's retry gets its own response back, never another client's
    again = post(server, key, {"ref": ref}, Authorization="Bearer bob")
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["run"] == bob.json()["run"]
    assert server.effects(ref) == 3


def test_methods_that_are_not_guarded_pass_through(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    with server.client() as client:
        for _ in range(2):
            answer = client.put(f"/orders/{ref}", headers=key_header(key))
            assert answer.status_code == 200
            assert "idempotent-replayed" not in answer.headers
    assert server.effects(ref) == 2


def test_a_request_without_a_key_passes_unguarded(server: Server) -> None:
    ref = unique("order")
    assert post(server, None, {"ref": ref}).status_code == 201
    assert post(server, None, {"ref": ref}).status_code == 201
    assert server.effects(ref) == 2


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ("plain-token", "quoted string"),
        ('"' + "k" * 96 + '"', "maximum is 95"),
        ('""', "empty"),
        ('"a", "b"', "after the key"),
    ],
)
def test_an_invalid_key_is_400_and_runs_nothing(server: Server, header: str, why: str) -> None:
    ref = unique("order")
    with server.client() as client:
        answer = client.post("/orders", json={"ref": ref}, headers={"Idempotency-Key": header})
    problem(answer, 400, "idempotency-key-invalid")
    assert why in answer.json()["detail"]
    assert server.effects(ref) == 0


def test_two_key_headers_are_400(server: Server) -> None:
    ref = unique("order")
    with server.client() as client:
        answer = client.post(
            "/orders",
            json={"ref": ref},
            headers=[("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')],
        )
    problem(answer, 400, "idempotency-key-invalid")
    assert server.effects(ref) == 0


def test_a_response_too_large_to_store_is_refused_and_undone(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    body = {"ref": ref, "size": 10_000}
    problem(post(server, key, body), 500, "response-too-large")
    # Transactional: rolled back. Lease: the effect was made and the claim released.
    assert server.effects(ref) == (1 if server.kind == "redis" else 0)
    problem(post(server, key, body), 500, "response-too-large")  # nothing stored: runs again
    assert server.effects(ref) == (2 if server.kind == "redis" else 0)


def test_a_request_body_over_the_limit_is_413(server: Server) -> None:
    key, ref = unique("k"), unique("order")
    problem(post(server, key, {"ref": ref, "pad": "x" * 70_000}), 413, "request-too-large")
    assert server.effects(ref) == 0
    # without a key the request is not guarded, and the limit is not the middleware's to apply
    assert post(server, None, {"ref": ref, "pad": "x" * 70_000}).status_code == 201
    assert server.effects(ref) == 1


# -- options --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def required_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve("sqlite", tmp_path_factory.mktemp("required"), required=True) as running:
        yield running


def test_required_key_missing_is_400(required_server: Server) -> None:
    ref = unique("order")
    problem(post(required_server, None, {"ref": ref}), 400, "idempotency-key-missing")
    assert required_server.effects(ref) == 0
    assert post(required_server, unique("k"), {"ref": ref}).status_code == 201
    assert required_server.effects(ref) == 1


@pytest.mark.parametrize(
    ("kind", "wait_s"), [("postgres", 30), ("redis", 30), ("postgres", None), ("redis", None)]
)
def test_wait_s_waits_for_the_first_and_replays(
    kind: str, wait_s: float | None, tmp_path: Path
) -> None:
    with serve(kind, tmp_path, wait_s=wait_s) as server:
        key, ref, gate = unique("k"), unique("order"), unique("gate")
        body = {"ref": ref, "gate": gate}
        answers: dict[str, httpx.Response] = {}
        first = threading.Thread(target=lambda: answers.update(first=post(server, key, body)))
        first.start()
        try:
            server.wait_started(gate)
            retry = threading.Thread(target=lambda: answers.update(retry=post(server, key, body)))
            retry.start()
            retry.join(0.5)
            assert retry.is_alive(), "the retry was answered without waiting for the first"
        finally:
            server.open_gate(gate)
            first.join(60)
        retry.join(60)
        assert answers["first"].status_code == 201
        assert answers["retry"].status_code == 201
        assert answers["retry"].headers["idempotent-replayed"] == "true"
        assert answers["retry"].json() == answers["first"].json()
        assert server.effects(ref) == 1


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_webhook_redeliveries_run_once(kind: str, tmp_path: Path) -> None:
    with serve(kind, tmp_path, webhook=True) as server, server.client() as client:
        event = unique("evt")
        for _ in range(3):  # a payment provider redelivers until it gets a 2xx
            answer = client.post("/webhooks/pay", json={"id": event, "type": "charge.succeeded"})
            assert answer.status_code == 200
        assert answer.headers["idempotent-replayed"] == "true"
        assert server.effects(event) == 1

        delivery = unique("gh")
        for _ in range(2):
            answer = client.post(
                "/webhooks/git", json={"zen": "hi"}, headers={"X-GitHub-Delivery": delivery}
            )
            assert answer.status_code == 200
        assert answer.headers["idempotent-replayed"] == "true"
        assert server.effects(delivery) == 1

        # an event without its id is a bad request, not a crash
        problem(client.post("/webhooks/pay", json={"type": "x"}), 400, "idempotency-key-invalid")


def test_the_apps_own_writes_wait_for_locks_as_usual(tmp_path: Path) -> None:
    """The claim's short lock timeout (PostgreSQL: how a retry learns the first still runs)
    must not reach the app's writes: one that waits for another transaction's row lock waits,
    it is not refused as a conflict."""
    with serve("postgres", tmp_path) as server:
        assert server.engine is not None
        locked, ref = unique("locked"), unique("order")
        with server.engine.begin() as conn:
            conn.execute(
                sa.text(f"INSERT INTO {server.business_table} (ref, run) VALUES (:r, 'x')"),
                {"r": locked},
            )
        answers: dict[str, httpx.Response] = {}
        with server.engine.connect() as holder:
            holder.execute(
                sa.text(f"UPDATE {server.business_table} SET run = 'held' WHERE ref = :r"),
                {"r": locked},
            )  # the row lock is held until this transaction ends
            body = {"ref": ref, "lock_ref": locked}
            sender = threading.Thread(
                target=lambda: answers.update(first=post(server, unique("k"), body))
            )
            sender.start()
            wait_for_lock_wait(server)
            holder.rollback()
        sender.join(60)
        assert answers["first"].status_code == 201, answers["first"].text
        assert server.effects(ref) == 1


def left_in_transaction(server: Server) -> int:
    """Connections idle in a transaction whose last statement was the in-flight lock: a retry
    answered 409 must end the transaction its lock began before its connection is reused."""
    assert server.engine is not None
    query = sa.text(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
        " AND query LIKE 'SELECT pg_try_advisory_xact_lock(%'"
    )
    with server.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def wait_for_lock_wait(server: Server, deadline_s: float = 20.0) -> None:
    """Until a statement on the server's business table waits for a lock (PostgreSQL)."""
    assert server.engine is not None
    query = sa.text(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q"
    )
    deadline = time.monotonic() + deadline_s
    with server.engine.connect() as conn:
        while not conn.execute(query, {"q": f"UPDATE {server.business_table}%"}).scalar_one():
            assert time.monotonic() < deadline, "the app's write never waited for the lock"
            time.sleep(0.01)
            conn.rollback()


def _race_one(url: str, key: str, body: dict[str, Any], barrier: Any, results: Any) -> None:
    """One client process of the race: wait for the others, send, report."""
    barrier.wait(30)
    with httpx.Client(base_url=url, timeout=60.0) as client:
        answer = client.post("/orders", json=body, headers=key_header(key))
    replayed = answer.headers.get("idempotent-replayed") == "true"
    results.put((answer.status_code, replayed, answer.text))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_concurrent_retries_from_several_processes_make_one_effect(
    kind: str, tmp_path: Path
) -> None:
    processes = 4
    with serve(kind, tmp_path) as server:
        key, ref, gate = unique("k"), unique("order"), unique("gate")
        body = {"ref": ref, "gate": gate}
        context = multiprocessing.get_context("spawn")
        barrier, results = context.Barrier(processes), context.Queue()
        clients = [
            context.Process(target=_race_one, args=(server.url, key, body, barrier, results))
            for _ in range(processes)
        ]
        for client in clients:
            client.start()
        try:
            # The one that won the claim waits at the gate; every other is told 409 meanwhile.
            losers = [results.get(timeout=60) for _ in range(processes - 1)]
            assert [status for status, _, _ in losers] == [409] * (processes - 1), losers
            server.open_gate(gate)
            winner = results.get(timeout=60)
        finally:
            server.open_gate(gate)
            for client in clients:
                client.join(30)
        assert winner[:2] == (201, False)
        assert server.effects(ref) == 1
        again = post(server, key, body)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.text == winner[2]
        assert server.effects(ref) == 1
