"""``idemq relay``, ``idemq outbox retry``, ``idemq worker --relay`` and ``idemq schema`` with
the outbox, on PostgreSQL and Redis Streams."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import idemq
from idemq.brokers import open_broker
from idemq.cli import EXIT_NOT_FOUND, EXIT_OK, main
from idemq.outbox import outbox_stats
from tests.conftest import PG_URL, REDIS_URL, free_port, require_service, unique

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def outbox() -> Iterator[idemq.Outbox]:
    require_service("postgres")
    require_service("redis")
    # A dedup table of its own: the default one is shared with every other test of this
    # database, and another xdist worker may be dropping it.
    store = idemq.SqlStore(PG_URL, table=unique("dd"))
    store.create_schema()
    box = idemq.Outbox(store, table=unique("ob"))
    box.create_schema()
    yield box
    box.drop_schema()
    store.drop_schema()
    store.close()


def _cli(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen([sys.executable, "-m", "idemq.cli", *args], env=env)


def _wait(condition: object, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.1)


def test_a_dead_row_retried_by_the_cli_is_delivered_once(outbox: idemq.Outbox) -> None:
    queue = unique("ship")
    client = redis.Redis.from_url(REDIS_URL)
    client.set(queue, "not a stream")  # XADD to it is refused (WRONGTYPE)
    consumer = open_broker(REDIS_URL)
    try:
        with outbox.engine.begin() as conn:
            doomed = outbox.add(conn, queue, b"ship o1")
        relay = idemq.OutboxRelay(outbox, REDIS_URL, max_attempts=1)
        assert relay.run_once().dead == [doomed]
        relay.close()
        assert outbox_stats(outbox).dead == 1
        client.delete(queue)
        consumer.declare(queue)
        retry = ["outbox", "retry", doomed, "--store", PG_URL, "--outbox-table", outbox.table]
        assert main(retry) == EXIT_OK
        assert main(retry) == EXIT_NOT_FOUND
        proc = _cli(
            "relay", "--store", PG_URL, "--broker", REDIS_URL, "--outbox-table", outbox.table
        )
        try:
            _wait(lambda: outbox_stats(outbox).pending == 0)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        got = []
        stream = consumer.consume(queue, prefetch=10)
        for _ in range(5):
            delivery = next(stream)
            if delivery is not None:
                got.append(delivery.message.id if delivery.message else None)
                delivery.ack()
        stream.close()
        assert got == [doomed]
        assert outbox_stats(outbox).dead == 0
    finally:
        consumer.delete_queue(queue)
        consumer.close()
        client.delete(queue)
        client.close()


HANDLER = """
import idemq
OUTBOX = idemq.Outbox(idemq.SqlStore({url!r}), table={table!r})

def pay(msg, tx):
    OUTBOX.add(tx, {ship!r}, b"ship " + msg.body, ordering_key=msg.body.decode())
    return {{"paid": True}}
"""


def test_worker_with_relay_publishes_what_its_handler_added(
    outbox: idemq.Outbox, tmp_path: Path
) -> None:
    """Both hops through one worker, and its metrics server exports the relay's outbox."""
    pay, ship = unique("pay"), unique("ship")
    (tmp_path / "payhandler.py").write_text(
        HANDLER.format(url=PG_URL, table=outbox.table, ship=ship)
    )
    broker = open_broker(REDIS_URL)
    broker.declare(pay)
    broker.declare(ship)
    for order in ("o1", "o2"):
        broker.publish(pay, order.encode(), message_id=f"PAY_{order}")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "idemq.cli",
            "worker",
            "payhandler:pay",
            "--broker",
            REDIS_URL,
            "--queue",
            pay,
            "--store",
            PG_URL,
            "--relay",
            "--outbox-table",
            outbox.table,
            "--metrics-port",
            str(metrics_port := free_port()),
        ],
        env=env,
        cwd=tmp_path,
    )
    got: list[bytes] = []
    published: dict[str, float] = {}
    try:
        stream = broker.consume(ship, prefetch=10)
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            delivery = next(stream)
            if delivery is not None:
                got.append(delivery.body)
                delivery.ack()
        stream.close()
        # The relay counts a row once its confirm came back and the row is marked sent.
        while published.get(outbox.table) != 2 and time.monotonic() < deadline:
            published = _scrape_outbox_published(metrics_port)
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        for name in (pay, ship):
            broker.delete_queue(name)
        broker.close()
    assert sorted(got) == [b"ship o1", b"ship o2"]
    assert published == {outbox.table: 2}


def _scrape_outbox_published(port: int) -> dict[str, float]:
    """``idemq_outbox_published_total`` by outbox, from the worker's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}  # not serving yet
    return {
        sample.labels["outbox"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "idemq_outbox_published_total"
    }


def test_schema_prints_the_outbox_ddl_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--dialect", "postgresql", "--outbox-table", "my_outbox"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "CREATE TABLE message_idempotent" in out
    assert "CREATE TABLE my_outbox" in out
    assert "CREATE TABLE my_outbox_dead" in out


def test_stats_shows_the_outbox_and_the_metrics_export_it(
    outbox: idemq.Outbox, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

    from idemq.observe.prometheus import OutboxCollector  # noqa: PLC0415

    with outbox.engine.begin() as conn:
        for i in range(3):
            outbox.add(conn, "nowhere", b"%d" % i)
    table = outbox.store.table.name
    args = ["stats", "--store", PG_URL, "--table", table, "--outbox-table", outbox.table, "--json"]
    assert main(args) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["outbox"]["pending"] == 3
    assert report["outbox"]["dead"] == 0
    assert report["outbox"]["oldest_pending_age_s"] >= 0
    assert "records" in report  # the store's own keys are all still there
    no_outbox = ["stats", "--store", PG_URL, "--table", table, "--outbox-table", "no_such_outbox"]
    assert main([*no_outbox, "--json"]) == EXIT_OK
    assert "outbox" not in json.loads(capsys.readouterr().out)

    relay = idemq.OutboxRelay(outbox, f"embedded://{tmp_path / 'q.db'}")
    registry = CollectorRegistry()
    registry.register(OutboxCollector(outbox, relays=[relay], min_interval_s=0))
    text = generate_latest(registry).decode()
    assert f'idemq_outbox_pending{{outbox="{outbox.table}"}} 3.0' in text
    assert f'idemq_outbox_published_total{{outbox="{outbox.table}"}} 0.0' in text
    assert "idemq_outbox_oldest_pending_age_seconds" in text
    assert f'idemq_outbox_dead_total{{outbox="{outbox.table}"}} 0.0' in text
