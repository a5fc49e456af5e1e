"""``idemq worker MODULE:HANDLER`` finds the handler in the current directory, like uvicorn."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa

from idemq.brokers.embedded import EmbeddedBroker

IDEMQ = str(Path(sys.executable).with_name("idemq"))

HANDLER = """
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
