"""DjangoStore: the handler's ORM writes and the dedup row commit together, on every database."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

import idemq
from idemq.integrations.django import DjangoStore
from tests.conftest import unique
from tests.integration.django.conftest import pay, payments


class Boom(Exception):
    pass


@pytest.fixture
def store(alias: str, stores: list[Any]) -> DjangoStore:
    made = DjangoStore(using=alias)
    stores.append(made)
    return made


def test_orm_writes_join_the_dedup_transaction(alias: str, store: DjangoStore):
    from django.db import connections  # noqa: PLC0415

    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")

    def handler(tx: Any) -> dict[str, str]:
        assert tx is connections[alias]
        assert tx.in_atomic_block
        pay(alias, order)
        return {"paid": order}

    first = guard.process("m-1", handler)
    again = guard.process("m-1", handler)
    assert first.status is idemq.Status.PROCESSED
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == {"paid": order}
    assert payments(alias, order) == 1


def test_a_failing_handler_leaves_nothing_and_runs_again(alias: str, store: DjangoStore):
    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")

    def fails(tx: Any) -> None:
        pay(alias, order)
        raise Boom

    with pytest.raises(Boom):
        guard.process("m-1", fails)
    assert payments(alias, order) == 0
    assert store.get("m-1", guard.policy.consumer) is None
    assert guard.process("m-1", lambda tx: pay(alias, order)).status is idemq.Status.PROCESSED
    assert payments(alias, order) == 1


def test_inside_the_callers_atomic_block_it_is_a_savepoint(alias: str, store: DjangoStore):
    from django.db import connections, transaction  # noqa: PLC0415

    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")
    outcomes: list[idemq.Outcome[Any]] = []

    def caller() -> None:
        with transaction.atomic(using=alias):
            outcomes.append(
                guard.process("m-1", lambda tx: pay(alias, order), connection=connections[alias])
            )
            raise Boom  # the caller's transaction rolls back: dedup row and effect with it

    with pytest.raises(Boom):
        caller()
    assert outcomes[0].status is idemq.Status.PROCESSED
    assert payments(alias, order) == 0
    assert store.get("m-1", guard.policy.consumer) is None
    with transaction.atomic(using=alias):
        guard.process("m-1", lambda tx: pay(alias, order), connection=connections[alias])
    assert guard.process("m-1", lambda tx: pay(alias, order)).status is idemq.Status.DUPLICATE
    assert payments(alias, order) == 1


def test_without_a_savepoint_a_failure_dooms_the_callers_block(alias: str, stores: list[Any]):
    """``savepoint=False``: the guard joins the caller's block, so its handler's failure rolls
    back the caller's own earlier write too; a success commits with the caller's block."""
    from django.db import connections, transaction  # noqa: PLC0415

    store = DjangoStore(using=alias, savepoint=False)
    stores.append(store)
    guard = idemq.Idempotency(store, consumer=unique("c"))
    before, order = unique("o"), unique("o")

    def failing(tx: Any) -> None:
        pay(alias, order)
        raise Boom

    def caller() -> None:
        with transaction.atomic(using=alias):
            pay(alias, before)  # the caller's own write, before the guard
            guard.process("m-1", failing, connection=connections[alias])

    with pytest.raises(Boom):
        caller()
    assert payments(alias, before) == payments(alias, order) == 0
    assert store.get("m-1", guard.policy.consumer) is None

    with transaction.atomic(using=alias):
        pay(alias, before)
        guard.process("m-1", lambda tx: pay(alias, order), connection=connections[alias])
    assert guard.process("m-1", lambda tx: pay(alias, order)).status is idemq.Status.DUPLICATE
    assert payments(alias, before) == payments(alias, order) == 1


def test_a_transaction_marked_for_rollback_is_never_acknowledged(alias: str, store: DjangoStore):
    """A handler that swallows an error inside ``atomic(savepoint=False)`` dooms the whole
    transaction: Django rolls it back at the end, so PROCESSED would be a lie."""
    from django.db import DatabaseError, transaction  # noqa: PLC0415

    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")

    def swallows(tx: Any) -> None:
        pay(alias, order)
        try:
            with transaction.atomic(using=alias, savepoint=False), tx.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table_here")
        except DatabaseError:
            pass

    with pytest.raises(idemq.TransactionLostError):
        guard.process("m-1", swallows)
    assert payments(alias, order) == 0
    assert store.get("m-1", guard.policy.consumer) is None


def test_postgres_aborted_transaction_is_never_acknowledged(alias: str, store: DjangoStore):
    """A failed statement aborts a PostgreSQL transaction; a handler that catches the error
    without a savepoint must not be reported PROCESSED (its COMMIT would roll back)."""
    from django.db import DatabaseError  # noqa: PLC0415

    if alias != "pg":
        pytest.skip("PostgreSQL aborts the transaction at a failed statement; others go on")
    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")

    def swallows(tx: Any) -> None:
        pay(alias, order)
        try:
            with tx.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table_here")
        except DatabaseError:
            pass

    with pytest.raises(idemq.TransactionLostError):
        guard.process("m-1", swallows)
    assert payments(alias, order) == 0
    assert guard.process("m-1", lambda tx: pay(alias, order)).status is idemq.Status.PROCESSED
    assert payments(alias, order) == 1


def test_lease_mode_claims_commit_at_once(alias: str, store: DjangoStore):
    """A lease claim is seen by other workers while the handler runs, even inside the
    caller's atomic() block on a database server (it is made on idemq's own connection; a
    SQLite file has one writer, which the caller's block holds)."""
    from django.db import transaction  # noqa: PLC0415

    block = contextlib.nullcontext() if alias == "sqlite" else transaction.atomic(using=alias)
    guard = idemq.Idempotency(store, consumer=unique("c"), mode="lease", lease_s=30)
    order = unique("o")
    seen: list[Any] = []

    def handler(tx: Any) -> str:
        assert tx is None
        other = idemq.SqlStore(store.own_store().engine, table="message_idempotent")
        seen.append(other.get("m-1", guard.policy.consumer))
        pay(alias, order)
        return "ok"

    with block:
        assert guard.process("m-1", handler).status is idemq.Status.PROCESSED
    assert seen[0] is not None
    assert seen[0].status is idemq.RecordStatus.PROCESSING
    again = guard.process("m-1", handler)
    assert again.status is idemq.Status.DUPLICATE
    assert again.result == "ok"
    assert payments(alias, order) == 1


def test_a_batch_keeps_the_others_when_one_fails(alias: str, store: DjangoStore):
    guard = idemq.Idempotency(store, consumer=unique("c"))
    prefix = unique("o")
    messages = [idemq.Message(id=f"m-{i}", body=b"") for i in range(4)]

    def handler(msg: idemq.Message, tx: Any) -> None:
        pay(alias, f"{prefix}-{msg.id}")
        if msg.id == "m-2":
            raise Boom

    outcomes = guard.process_batch(messages, handler)
    assert [o.status for o in outcomes].count(idemq.Status.PROCESSED) == 3
    assert [payments(alias, f"{prefix}-m-{i}") for i in range(4)] == [1, 1, 0, 1]
    again = guard.process_batch(messages, lambda msg, tx: pay(alias, f"{prefix}-{msg.id}"))
    assert [o.status for o in again].count(idemq.Status.DUPLICATE) == 3
    assert [payments(alias, f"{prefix}-m-{i}") for i in range(4)] == [1, 1, 1, 1]


def test_an_in_memory_sqlite_database_works_in_transactional_mode(
    django_project: Any, stores: list[Any]
):
    """Django's test runner puts a SQLite project in memory: the store must need no
    connection of its own there (another one would see an empty database)."""
    store = DjangoStore(using="memory")
    stores.append(store)
    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")
    for _ in range(2):
        guard.process("m-1", lambda tx: pay("memory", order))
    assert payments("memory", order) == 1
    with pytest.raises(idemq.ConfigurationError, match="SQLite database file"):
        store.stats()


@pytest.mark.parametrize("alias", ["pg"], indirect=True)  # a session ends itself on PostgreSQL
def test_a_connection_dropped_under_a_handler_is_an_outage(alias: str, store: DjangoStore):
    """The server ends the session mid-transaction (as a restart or a failover would): nothing
    of the message commits, the guard reports an outage (retry later), not the handler's
    failure, and the message runs once on Django's next connection."""
    from django.db import connections  # noqa: PLC0415

    guard = idemq.Idempotency(store, consumer=unique("c"))
    order = unique("o")

    def dropped(tx: Any) -> None:
        pay(alias, order)
        with tx.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    try:
        with pytest.raises(idemq.StoreUnavailableError):
            guard.process("m-1", dropped)
    finally:
        connections[alias].close()  # Django reconnects on the next query
    assert payments(alias, order) == 0
    assert guard.process("m-1", lambda tx: pay(alias, order)).status is idemq.Status.PROCESSED
    assert payments(alias, order) == 1
