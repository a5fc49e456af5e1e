"""``idemq worker``'s logs off a terminal: one line per record, whole ids, JSON on demand, and
expected failures without tracebacks. Real worker subprocesses, stderr to a file."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from idemq.brokers.embedded import EmbeddedBroker

IDEMQ = str(Path(sys.executable).with_name("idemq"))

HANDLER = """
def handle(msg, tx):
    return {"ok": msg.id}
"""

RECORD_START = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) ")


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def run_worker(
    tmp_path: Path, ids: list[str], *extra: str, store: str | None = None, until: str = ""
) -> tuple[int, str]:
    """Publish ``ids`` to an embedded queue, run a worker until ``until`` is logged (or 20 s),
    SIGTERM it; return its exit code and its stderr."""
    (tmp_path / "log_handlers.py").write_text(HANDLER)
    queue_db = tmp_path / "q.db"
    broker = EmbeddedBroker(queue_db)
    for message_id in ids:
        broker.publish("orders", b"{}", message_id=message_id)
    broker.close()
    log = tmp_path / "worker.log"
    command = [
        IDEMQ,
        "worker",
        "log_handlers:handle",
        "--broker",
        f"embedded:///{queue_db}",
        "--queue",
        "orders",
        "--store",
        store or f"sqlite:///{tmp_path / 'store.db'}",
        "--max-attempts",
        "1",
        *extra,
    ]
    with log.open("w") as sink:
        worker = subprocess.Popen(command, cwd=tmp_path, stderr=sink, stdout=sink)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and worker.poll() is None:
                if until and log.read_text().count(until) >= 1:
                    break
                time.sleep(0.1)
            time.sleep(0.3)
        finally:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
            code = worker.wait(30)
    return code, log.read_text()


def test_a_long_message_id_stays_whole_on_one_line(tmp_path: Path):
    long_id = "ORDER_" + "7" * 194  # 200 characters: past any terminal width, and invalid
    fine_id = "ORDER_" + "8" * 114  # 120 characters: valid, logged as a duplicate
    code, text = run_worker(tmp_path, [long_id, fine_id, fine_id], until="idemq duplicate")
    assert code == 0, text
    lines = text.splitlines()
    dead = [line for line in lines if "dead_lettered" in line]
    assert len(dead) == 1, text
    assert long_id in dead[0]
    assert any(fine_id in line and "idemq duplicate" in line for line in lines), text
    for line in lines:  # every line is a record of its own: nothing was wrapped onto the next
        assert RECORD_START.match(line), line
    assert "\x1b[" not in text  # no colour codes in a file


def test_json_log_lines_carry_the_message_fields(tmp_path: Path):
    long_id = "ORDER_" + "7" * 194
    fine_id = "ORDER_20240115143000123_NODE01_0001"
    code, text = run_worker(
        tmp_path, [long_id, fine_id, fine_id], "--log-format", "json", until="duplicate"
    )
    assert code == 0, text
    records = [json.loads(line) for line in text.splitlines()]  # every line is one object
    keys = {"time", "level", "logger", "message"}
    keys |= {"message_id", "consumer", "outcome", "duration_ms", "error_class"}
    for record in records:
        assert keys <= record.keys(), record
    [duplicate] = [r for r in records if r["outcome"] == "duplicate"]
    assert duplicate["message_id"] == fine_id
    assert duplicate["consumer"] == "orders"
    assert isinstance(duplicate["duration_ms"], float)
    assert duplicate["error_class"] is None
    invalid = [r for r in records if r["message_id"] == long_id and r["outcome"] == "error"]
    assert [r["error_class"] for r in invalid] == ["InvalidMessageIdError"]
    assert any(r["message"].startswith("idemq worker ready") for r in records)
    assert any(r["message"].startswith("idemq worker stopped") for r in records)


def test_a_store_outage_is_one_line_per_attempt_without_traceback(tmp_path: Path):
    store = f"redis://127.0.0.1:{closed_port()}/0"
    code, text = run_worker(tmp_path, ["ORDER_1"], store=store, until="StoreUnavailableError")
    assert code == 0, text
    outage = [line for line in text.splitlines() if "StoreUnavailableError" in line]
    assert outage, text
    assert "Traceback" not in text
    for line in text.splitlines():
        assert RECORD_START.match(line), line


def test_a_store_down_at_start_up_is_one_line_and_exit_4(tmp_path: Path):
    store = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/test"
    code, text = run_worker(tmp_path, ["ORDER_1"], store=store)
    assert code == 4, text
    assert text.count("\n") == 1, text  # one line, ending the output
    assert text.startswith("store error: ")
    assert "Traceback" not in text
