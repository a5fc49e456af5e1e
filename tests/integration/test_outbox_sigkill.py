"""``idemq relay`` SIGKILLed mid-batch re-publishes at most one batch (``--batch-size`` rows),
each under its own id; every row arrives (PostgreSQL outbox and SQLite's leases, RabbitMQ)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import idemq
from idemq.brokers import open_broker
from idemq.outbox import outbox_stats
from tests.conftest import PG_URL, require_service, unique
from tests.integration.test_outbox_relay import AMQP_URL, receive

IDEMQ = str(Path(sys.executable).with_name("idemq"))
BATCH = 10
ROWS = 600


@pytest.fixture(params=["postgres", "sqlite"])
def outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[idemq.Outbox]:
    require_service("rabbitmq")
    if request.param == "postgres":
        require_service("postgres")
        url = PG_URL
    else:
        url = f"sqlite:///{tmp_path / 'outbox.db'}"
    store = idemq.SqlStore(url)
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.close()


def _relay(box: idemq.Outbox) -> subprocess.Popen[bytes]:
    store = box.engine.url.render_as_string(hide_password=False)
    return subprocess.Popen(
        [IDEMQ, "relay", "--store", store, "--broker", AMQP_URL, "--outbox-table", box.table,
         "--batch-size", str(BATCH)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _wait(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_relay_killed_mid_batch_republishes_at_most_one_batch(outbox: idemq.Outbox) -> None:
    queue = unique("q")
    consumer = open_broker(AMQP_URL)
    consumer.declare(queue)
    with outbox.engine.begin() as conn:
        made = [outbox.add(conn, queue, b"%d" % n) for n in range(ROWS)]
    first = _relay(outbox)
    try:
        # Killed while the backlog is long: its batches follow each other without a pause.
        _wait(lambda: outbox_stats(outbox).pending <= ROWS - 5 * BATCH, 60, "first relay idle")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    left = outbox_stats(outbox).pending
    assert left > 0, "the backlog was gone before the kill: nothing shows the bound"
    second = _relay(outbox)
    try:
        _wait(lambda: outbox_stats(outbox).pending == 0, 120, "second relay did not drain")
    finally:
        second.terminate()
        second.wait(30)
    got = receive(consumer, queue, ROWS + BATCH + 1, timeout_s=15)
    consumer.delete_queue(queue)
    consumer.close()
    copies = Counter(d.message.id for d in got if d.message)
    assert set(copies) == set(made)  # every row arrived
    twice = sum(count - 1 for count in copies.values())
    assert twice <= BATCH, f"{twice} rows published twice: more than one batch"
    assert max(copies.values()) <= 2  # one kill: a second copy at most
