"""``Outbox(DjangoStore()).add(connection, …)`` joins Django's atomic(); ``manage.py idemq relay``
publishes what committed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import idemq
from idemq.integrations.django import DjangoStore
from tests.conftest import unique
from tests.integration.django.conftest import MANAGE, ROOT, pay, payments, subprocess_env


class Boom(Exception):
    pass


def _rows(store: DjangoStore, destination: str) -> int:
    with store.engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT COUNT(*) FROM idemq_outbox WHERE destination = :d"), {"d": destination}
        ).scalar_one()
    return int(found)


def test_outbox_rows_commit_with_the_handlers_writes(alias: str, stores: list[Any]):
    from django.db import connections, transaction  # noqa: PLC0415

    store = DjangoStore(using=alias)
    stores.append(store)
    outbox = idemq.Outbox(store)
    guard = idemq.Idempotency(store, consumer=unique("c"))
    order, destination = unique("o"), unique("dest")

    def handler(tx: Any) -> None:
        pay(alias, order)
        outbox.add(tx, destination, b'{"paid": true}')

    def failing(tx: Any) -> None:
        handler(tx)
        raise Boom

    with pytest.raises(Boom):
        guard.process("m-1", failing)
    assert (payments(alias, order), _rows(store, destination)) == (0, 0)
    guard.process("m-1", handler)
    guard.process("m-1", handler)
    assert (payments(alias, order), _rows(store, destination)) == (1, 1)

    # Outside a guard, in the caller's own atomic() block: rolled back with it.
    def caller() -> None:
        with transaction.atomic(using=alias):
            outbox.add(connections[alias], destination, b"{}")
            raise Boom

    with pytest.raises(Boom):
        caller()
    assert _rows(store, destination) == 1


def test_manage_py_relay_publishes_what_committed(
    alias: str, django_project: Any, stores: list[Any], tmp_path: Path
):
    from django.db import connections, transaction  # noqa: PLC0415

    store = DjangoStore(using=alias)
    stores.append(store)
    destination = unique("dest")
    with transaction.atomic(using=alias):
        idemq.Outbox(store).add(connections[alias], destination, b"hello")
    assert _rows(store, destination) == 1
    broker = f"embedded:///{tmp_path / 'queue.db'}"
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        relay = subprocess.Popen(
            [sys.executable, str(MANAGE), "idemq", "relay", "--broker", broker],
            env=subprocess_env(django_project, alias),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while _rows(store, destination) and time.monotonic() < deadline:
            assert relay.poll() is None, log.read_text(errors="replace")
            time.sleep(0.05)
        assert _rows(store, destination) == 0, "the relay published and deleted the row"
    finally:
        relay.send_signal(signal.SIGINT)
        try:
            relay.wait(timeout=20)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait()
