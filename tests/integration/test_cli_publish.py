"""``idemq publish`` puts one message with a stamped (or given) id on a broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import idemq
from idemq.brokers.embedded import EmbeddedBroker
from idemq.brokers.rabbitmq import RabbitMQBroker
from tests.conftest import require_service, unique

IDEMQ = str(Path(sys.executable).with_name("idemq"))


def test_publish_stamps_an_id_and_the_consumer_sees_it(tmp_path: Path):
    url = f"embedded:///{tmp_path / 'q.db'}"
    done = subprocess.run(
        [
            IDEMQ,
            "publish",
            "--broker",
            url,
            "--queue",
            "orders",
            "--prefix",
            "ORDER",
            "--business-id",
            "order_7",
            "--header",
            "source=cli",
            '{"amount": 3}',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    message_id = done.stdout.strip()
    assert idemq.parse_message_id(message_id).prefix == "ORDER"

    broker = EmbeddedBroker(tmp_path / "q.db")
    try:
        delivery = next(d for d in broker.consume("orders") if d is not None)
        msg = delivery.message
        assert msg is not None
        assert (msg.id, msg.business_id, msg.json()) == (message_id, "order_7", {"amount": 3})
        assert msg.headers["source"] == "cli"
        delivery.ack()
    finally:
        broker.close()


def test_publish_reads_stdin_and_keeps_a_given_id(tmp_path: Path):
    url = f"embedded:///{tmp_path / 'q.db'}"
    done = subprocess.run(
        [IDEMQ, "publish", "--broker", url, "--queue", "q", "--id", "PAY_1", "-"],
        input=b"raw bytes",
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == b"PAY_1"
    broker = EmbeddedBroker(tmp_path / "q.db")
    try:
        delivery = next(d for d in broker.consume("q") if d is not None)
        assert delivery.message is not None
        assert delivery.message.body == b"raw bytes"
        delivery.ack()
    finally:
        broker.close()


def test_a_bad_header_is_a_usage_error(tmp_path: Path):
    done = subprocess.run(
        [
            IDEMQ,
            "publish",
            "--broker",
            f"embedded:///{tmp_path / 'q.db'}",
            "--queue",
            "q",
            "--header",
            "novalue",
            "x",
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2


def test_publish_to_a_rabbitmq_queue_nobody_declared_exits_4_and_says_so(tmp_path: Path):
    require_service("rabbitmq")
    url = "amqp://guest:guest@127.0.0.1:5672/"
    queue = unique("undeclared")
    command = [IDEMQ, "publish", "--queue", queue, "--id", "PAY_1", "{}"]
    env = {**os.environ, "IDEMQ_BROKER_URL": url}  # a password: not on the command line
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout == ""  # no id printed for a message that went nowhere
    assert done.stderr.splitlines() == [
        f"broker error: RabbitMQ returned the message: no queue {queue!r} to route it to"
        " (declare the queue, or start its worker, before publishing)"
    ]

    broker = RabbitMQBroker(url)
    try:
        broker.declare(queue)
        again = subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=False, env=env
        )
        assert again.returncode == 0, again.stderr
        assert again.stdout.strip() == "PAY_1"
        stream = broker.consume(queue)
        delivery = next(d for d in stream if d is not None)
        assert delivery.message is not None
        assert delivery.message.id == "PAY_1"  # exactly the one that was routed
        delivery.ack()
        stream.close()
    finally:
        broker.delete_queue(queue)
        broker.close()


def _publish_with(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    url = f"embedded:///{tmp_path / 'q.db'}"
    return subprocess.run(
        [IDEMQ, "publish", "--broker", url, "--queue", "q", *extra, "body"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _queued(tmp_path: Path) -> int:
    broker = EmbeddedBroker(tmp_path / "q.db")
    try:
        return broker.depth("q")
    finally:
        broker.close()


def test_publish_refuses_an_id_every_consumer_would_dead_letter(tmp_path: Path):
    # 10 KB of id: the guard refuses it (> 128 characters), so every consumer dead-letters it.
    done = _publish_with(tmp_path, "--id", "X" * 10_000)
    assert done.returncode == 2, done.stderr
    assert "10000 characters, the maximum is 128" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert _queued(tmp_path) == 0  # nothing reached the queue


def test_publish_refuses_a_business_id_the_guard_would_refuse(tmp_path: Path):
    done = _publish_with(tmp_path, "--business-id", "b" * 65)
    assert done.returncode == 2, done.stderr
    assert _queued(tmp_path) == 0


def test_an_invalid_id_is_refused_before_the_broker_is_even_reached():
    unreachable = "amqp://guest:guest@127.0.0.1:1/"
    done = subprocess.run(
        [IDEMQ, "publish", "--broker", unreachable, "--queue", "q", "--id", "X" * 200, "body"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr  # not 4: nothing was tried
