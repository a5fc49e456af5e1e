"""What ``idemq worker`` logs about a failing handler: by default the exception's class and where
it was raised, never its text (a handler's error often quotes the payload: a card number, an
address) nor a traceback; ``--log-error-text`` adds both. Real worker subprocesses."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from idemq.brokers.embedded import EmbeddedBroker
from tests.integration.test_cli_logs import IDEMQ, RECORD_START

SECRET = "card 4111111111111111 of alice@example.com"

HANDLER = f"""
def handle(msg, tx):
    raise ValueError({SECRET!r})
"""


def _run_failing_worker(tmp_path: Path, *extra: str) -> str:
    """Two messages through a handler that always fails (2 attempts each, then dead-lettered);
    the worker's stderr."""
    (tmp_path / "failing.py").write_text(HANDLER)
    queue_db = tmp_path / "q.db"
    broker = EmbeddedBroker(queue_db)
    for message_id in ("ORDER_1", "ORDER_2"):
        broker.publish("orders", b"{}", message_id=message_id)
    broker.close()
    log = tmp_path / "worker.log"
    command = [IDEMQ, "worker", "failing:handle", "--broker", f"embedded:///{queue_db}"]
    command += ["--queue", "orders", "--store", f"sqlite:///{tmp_path / 'store.db'}"]
    command += ["--max-attempts", "2", *extra]
    with log.open("w") as sink:
        worker = subprocess.Popen(command, cwd=tmp_path, stderr=sink, stdout=sink)
        try:
            deadline = time.monotonic() + 60
            while log.read_text().count("dead_lettered") < 2:
                assert worker.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0, log.read_text()
    broker = EmbeddedBroker(queue_db)
    try:  # the business effect of the run: both messages in the dead-letter queue
        assert broker.depth(broker.dead_letter_queue("orders")) == 2
    finally:
        broker.close()
    return log.read_text()


def test_a_handler_error_is_logged_without_its_text_by_default(tmp_path: Path) -> None:
    text = _run_failing_worker(tmp_path)
    assert "4111111111111111" not in text
    assert "alice@example.com" not in text
    assert "Traceback" not in text
    failed = [line for line in text.splitlines() if "handler failed on" in line]
    assert len(failed) == 4, text  # 2 messages x 2 attempts
    for line in failed:
        assert RECORD_START.match(line), line
        # what an operator acts on: which exception, and where it was raised
        assert "ValueError raised at failing.py:3 in handle" in line, line


def test_log_error_text_logs_the_text_and_the_traceback(tmp_path: Path) -> None:
    text = _run_failing_worker(tmp_path, "--log-error-text")
    failed = [line for line in text.splitlines() if "handler failed on" in line]
    assert len(failed) == 4, text
    for line in failed:
        assert f"ValueError: {SECRET}" in line, line
    assert "Traceback" in text
