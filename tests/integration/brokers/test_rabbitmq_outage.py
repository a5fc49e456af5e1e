"""A RabbitMQ worker that was running meets a permanent outage: the same behaviour as at start-up
(one line per attempt, exit 4 after ``--give-up-after``), and SIGTERM stays prompt.

The outage is a TCP proxy between the worker and RabbitMQ that the test cuts (the shared
RabbitMQ keeps running): connections are dropped and new ones closed at once.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from idemq.brokers.rabbitmq import RabbitMQBroker
from tests.conftest import require_service, unique
from tests.contract._proxy import CuttableProxy

pytestmark = pytest.mark.rabbitmq

IDEMQ = str(Path(sys.executable).with_name("idemq"))
URL = "amqp://guest:guest@127.0.0.1:{port}/"
HANDLER = """
import sqlalchemy as sa

def handle(msg, tx):
    tx.execute(sa.text("INSERT INTO effects (message_id) VALUES (:m)"), {"m": msg.id})
"""


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _running_worker_cut_off(tmp_path: Path, *extra: str):
    """A worker (through a proxy) that applied one message; then the proxy is cut."""
    require_service("rabbitmq")
    (tmp_path / "outage_handlers.py").write_text(HANDLER)
    store = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = sa.create_engine(store)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE effects (message_id TEXT)")
    queue = unique("q")
    proxy = CuttableProxy(("127.0.0.1", 5672))
    log = tmp_path / "worker.log"
    sink = log.open("w")
    command = [IDEMQ, "worker", "outage_handlers:handle", "--broker", URL.format(port=proxy.port)]
    command += ["--queue", queue, "--store", store, *extra]
    worker = subprocess.Popen(command, cwd=tmp_path, stderr=sink, stdout=sink)
    publisher = RabbitMQBroker(URL.format(port=5672))

    def effects() -> int:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT COUNT(*) FROM effects").scalar_one())

    try:
        _wait(lambda: "idemq worker ready" in log.read_text(), 30, log.read_text())
        publisher.publish(queue, b"{}", message_id=f"M_{queue}")
        _wait(lambda: effects() == 1, 30, log.read_text())  # it was running, for real
        proxy.cut()
    except BaseException:
        worker.kill()
        worker.wait()
        raise
    return worker, log, proxy, publisher, queue, sink, engine


def _cleanup(worker, proxy, publisher, queue, sink, engine) -> None:
    if worker.poll() is None:
        worker.kill()
        worker.wait()
    proxy.close()
    publisher.delete_queue(queue)
    publisher.close()
    sink.close()
    engine.dispose()


def test_a_running_worker_retries_an_outage_then_exits_4(tmp_path: Path) -> None:
    worker, log, proxy, publisher, queue, sink, engine = _running_worker_cut_off(
        tmp_path, "--give-up-after", "4"
    )
    try:
        cut_at = time.monotonic()
        code = worker.wait(timeout=60)
        took_s = time.monotonic() - cut_at
        text = log.read_text()
        assert code == 4, text
        assert took_s <= 4 + 10, (took_s, text)
        retries = re.findall(r"failed \(attempt \d+\), retrying in", text)
        assert retries, text  # one line per attempt, as at start-up
        assert re.search(r"broker unavailable: .*gave up after \d+ attempts? in", text), text
    finally:
        _cleanup(worker, proxy, publisher, queue, sink, engine)


def test_sigterm_during_an_outage_is_prompt(tmp_path: Path) -> None:
    worker, log, proxy, publisher, queue, sink, engine = _running_worker_cut_off(tmp_path)
    try:
        _wait(lambda: "retrying in" in log.read_text(), 30, log.read_text())
        asked_at = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        took_s = time.monotonic() - asked_at
        assert code == 0, log.read_text()
        assert took_s <= 5, (took_s, log.read_text())
    finally:
        _cleanup(worker, proxy, publisher, queue, sink, engine)


def test_a_running_worker_resumes_once_rabbitmq_is_back(tmp_path: Path) -> None:
    worker, log, proxy, publisher, queue, sink, engine = _running_worker_cut_off(tmp_path)
    try:
        _wait(lambda: "retrying in" in log.read_text(), 30, log.read_text())
        proxy.restore()
        for n in range(3):
            publisher.publish(queue, b"{}", message_id=f"N{n}_{queue}")

        def effects() -> int:
            with engine.connect() as conn:
                return int(conn.exec_driver_sql("SELECT COUNT(*) FROM effects").scalar_one())

        _wait(lambda: effects() == 4, 90, log.read_text())  # each once, none stuck or lost
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, log.read_text()
        assert effects() == 4
    finally:
        _cleanup(worker, proxy, publisher, queue, sink, engine)
