"""DjangoStore reports database failures through idemq's one SQL error boundary: Django's and
the driver's exceptions come out as the idemq error they stand for."""

from __future__ import annotations

from typing import Any

import pytest

import idemq
from idemq.integrations.django import DjangoStore
from tests.conftest import unique
from tests.integration.django.conftest import pay, payments


@pytest.fixture
def store(alias: str, stores: list[Any]) -> DjangoStore:
    made = DjangoStore(using=alias)
    stores.append(made)
    return made


def test_a_connection_dropped_under_a_handler_is_an_outage(alias: str, store: DjangoStore):
    """The server ends the session mid-transaction (as a restart or a failover would): nothing
    of the message commits, the guard reports an outage (retry later), not the handler's
    failure, and the message runs once on Django's next connection."""
    from django.db import connections  # noqa: PLC0415

    if alias != "pg":
        pytest.skip("a session ends itself with pg_terminate_backend on PostgreSQL only")
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
