"""The broker contract on the embedded SQLite queue (no server needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from idemq.brokers.embedded import EmbeddedBroker
from idemq.brokers.settlement import Verdict
from idemq.errors import AlreadySettledError
from idemq.message import Message
from idemq.worker.loop import Worker
from idemq.worker.run import open_guard
from tests.conftest import unique
from tests.contract.brokers import FAST, SRC, BrokerContract, Business, Running, wait_for


class TestEmbedded(BrokerContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self, tmp_path: Path) -> str:
        # A 1 s visibility timeout so a crashed consumer's message comes back quickly.
        return f"embedded://{tmp_path / 'queue.db'}?visibility_timeout_s=1"


def test_visibility_timeout_redelivers_without_counting_an_attempt(tmp_path: Path) -> None:
    now = [1_000_000]
    broker = EmbeddedBroker(tmp_path / "q.db", visibility_timeout_s=5, clock_ms=lambda: now[0])
    broker.publish("q", b"{}", message_id="A")
    first = next(broker.consume("q"))
    assert first is not None
    assert first.message is not None
    assert first.delivery_attempt == 1
    assert next(broker.consume("q")) is None  # hidden while held
    now[0] += 5_000
    second = next(broker.consume("q"))  # the holder "crashed": visible again
    assert second is not None
    assert second.delivery_attempt == 1, "no handler run failed: not an attempt"
    first.ack()  # stale receipt: ignored (logged), the row is still held by the second receipt
    assert broker.depth("q") == 1
    second.ack()
    assert broker.depth("q") == 0
    broker.close()


def test_retry_delay_and_dead_letter_are_atomic_moves(tmp_path: Path) -> None:
    now = [0]
    broker = EmbeddedBroker(tmp_path / "q.db", clock_ms=lambda: now[0])
    broker.publish("q", b"x", message_id="A")
    delivery = next(broker.consume("q"))
    assert delivery is not None
    delivery.retry(2.0)  # an outage's retry: the same attempt comes back
    assert next(broker.consume("q")) is None
    now[0] += 2_000
    same = next(broker.consume("q"))
    assert same is not None
    assert same.delivery_attempt == 1
    same.retry(1.0, counted=True)  # after a failed handler run: the next attempt
    now[0] += 1_000
    again = next(broker.consume("q"))
    assert again is not None
    assert again.delivery_attempt == 2
    assert "idemq-delivery-attempt" not in again.headers
    again.dead_letter("invalid_message: test")
    assert broker.depth("q") == 0
    dead = next(broker.consume("q.dlq"))
    assert dead is not None
    assert dead.headers["idemq-dead-letter-reason"] == "invalid_message: test"
    assert dead.headers["idemq-original-queue"] == "q"
    assert dead.headers["idemq-delivery-attempts"] == "2"
    broker.close()


def test_settling_twice_raises(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path / "q.db")
    broker.publish("q", b"x", message_id="A")
    delivery = next(broker.consume("q"))
    assert delivery is not None
    delivery.ack()
    assert delivery.settled
    with pytest.raises(AlreadySettledError):
        delivery.retry(0)
    broker.close()


COUNTING_HANDLER = """
import os
import sqlalchemy as sa

def handle(msg, tx):
    tx.execute(
        sa.text(f"INSERT INTO {os.environ['EFFECTS_TABLE']} (message_id, n) VALUES (:m, :p)"),
        {"m": msg.id, "p": os.getpid()},
    )
"""

RUN_WORKER = """
import logging, sys
from idemq.worker.run import run_worker

logging.basicConfig(level=logging.INFO)
run_worker("counting_handler:handle", broker_url=sys.argv[1], queue=sys.argv[2],
           store_url=sys.argv[3], consumer="shared", concurrency=2)
"""


def test_several_worker_processes_share_one_queue(tmp_path: Path) -> None:
    (tmp_path / "counting_handler.py").write_text(COUNTING_HANDLER)
    business = Business(f"sqlite:///{tmp_path / 'business.db'}")
    url = f"embedded://{tmp_path / 'queue.db'}?visibility_timeout_s=5"
    broker = EmbeddedBroker.from_url(url)
    ids = [f"P{i:03d}" for i in range(60)]
    for message_id in ids:
        broker.publish("q", b"{}", message_id=message_id)
    env = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}",
        "EFFECTS_TABLE": business.table,
    }
    logs = [tmp_path / f"worker{n}.log" for n in range(3)]
    sinks = [log.open("w") for log in logs]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RUN_WORKER, url, "q", business.url], env=env, stderr=sink
        )
        for sink in sinks
    ]
    try:
        wait_for(lambda: set(business.counts()) == set(ids), 60, "all 60 effects")
        wait_for(lambda: broker.depth("q") == 0, 20, "every message acked")
        # A SIGTERM that lands while a worker still imports kills it before its handler is
        # installed; the graceful stop is what this test is about, so wait for readiness.
        wait_for(
            lambda: all("idemq worker ready" in log.read_text() for log in logs),
            30,
            "every worker ready",
        )
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(30) for proc in procs]
        broker.close()
        for sink in sinks:
            sink.close()
    assert codes == [0, 0, 0]
    assert business.counts() == Counter({message_id: 1 for message_id in ids})
    business.drop()


def test_redis_lease_store_guards_an_effect_outside_the_store(
    tmp_path: Path, redis_url: str
) -> None:
    business = Business(f"sqlite:///{tmp_path / 'business.db'}")
    guard = open_guard(redis_url, unique("c"))
    assert guard.mode.name == "LEASE"

    def handler(msg: Message, tx: object) -> None:
        assert tx is None  # lease mode: the effect is not in the store's transaction
        with business.engine.begin() as conn:
            conn.execute(
                sa.text(f"INSERT INTO {business.table} (message_id, n) VALUES (:m, 1)"),
                {"m": msg.id},
            )

    broker = EmbeddedBroker(tmp_path / "q.db")
    for message_id in ["R1", "R2", "R1"]:  # R1 twice: a producer retry
        broker.publish("q", b"{}", message_id=message_id)
    worker = Worker(handler, broker, guard, "q", policy=FAST)
    running = Running(worker)
    wait_for(lambda: worker.stats.deliveries == 3, 20, "three deliveries")
    running.stop()
    guard.store.close()
    assert business.counts() == Counter({"R1": 1, "R2": 1})
    assert worker.stats.verdicts[Verdict.DUPLICATE] == 1
    business.drop()
