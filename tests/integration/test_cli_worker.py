"""``idemq worker MODULE:HANDLER`` finds the handler in the current directory, like uvicorn."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from idemq.brokers.embedded import EmbeddedBroker

IDEMQ = str(Path(sys.executable).with_name("idemq"))

HANDLER = """
import pytest
import sqlalchemy as sa

def handle(msg, tx):
    tx.execute(sa.text("INSERT INTO effects (message_id) VALUES (:m)"), {"m": msg.id})
"""


def test_worker_runs_a_handler_from_the_current_directory(tmp_path: Path):
    (tmp_path / "shop_handlers.py").write_text(HANDLER)
    store_url = f"sqlite:///{tmp_path / 'shop.db'}"
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE effects (message_id TEXT)")
    broker = EmbeddedBroker(tmp_path / "q.db")
    for message_id in ("A", "B", "A"):  # a producer retry: A twice
        broker.publish("orders", b"{}", message_id=message_id)
    broker.close()

    log = tmp_path / "worker.log"
    with log.open("w") as sink:
        worker = subprocess.Popen(
            [
                IDEMQ,
                "worker",
                "shop_handlers:handle",
                "--broker",
                f"embedded:///{tmp_path / 'q.db'}",
                "--queue",
                "orders",
                "--store",
                store_url,
            ],
            cwd=tmp_path,
            stderr=sink,
            stdout=sink,
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with engine.connect() as conn:
                    if conn.exec_driver_sql("SELECT COUNT(*) FROM effects").scalar() == 2:
                        break
                assert worker.poll() is None, log.read_text()
                time.sleep(0.1)
            time.sleep(0.5)  # the duplicate A gets its turn too
        finally:
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(30)
    with engine.connect() as conn:
        rows = sorted(r[0] for r in conn.exec_driver_sql("SELECT message_id FROM effects"))
    engine.dispose()
    assert code == 0, log.read_text()
    assert "idemq worker ready" in log.read_text()
    assert rows == ["A", "B"]


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("def handle(msg, tx)\n    return 1\n", "SyntaxError"),
        ("raise RuntimeError('no config here')\n", "RuntimeError: no config here"),
        ("import sqlalchemy\nundefined_name + 1\n", "NameError"),
    ],
    ids=["syntax-error", "raises-at-import", "name-error"],
)
def test_a_handler_module_that_fails_to_import_is_one_line_and_exit_2(
    tmp_path: Path, source: str, error: str
):
    (tmp_path / "broken_handlers.py").write_text(source)
    done = subprocess.run(
        [
            IDEMQ,
            "worker",
            "broken_handlers:handle",
            "--broker",
            f"embedded:///{tmp_path / 'q.db'}",
            "--queue",
            "orders",
            "--store",
            f"sqlite:///{tmp_path / 'shop.db'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback
    assert "broken_handlers" in lines[0]
    assert error in lines[0]
