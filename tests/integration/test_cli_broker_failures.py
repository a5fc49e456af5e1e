"""One failure behaviour on every broker, as ``idemq worker`` shows it (real subprocesses):

* an outage (nothing listens on the port) is retried with backoff, one log line per attempt and
  no traceback, never logged as "ready", and the worker exits 4 once ``--give-up-after`` passed;
* a configuration error (a refused login, an unknown vhost) stops it at once: one line, exit 2;
* with ``--relay`` the relay thread follows the same outage policy: same lines, same give-up.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import idemq
from tests.conftest import require_service, unique
from tests.contract._proxy import CuttableProxy
from tests.integration.test_cli_logs import RECORD_START, closed_port

IDEMQ = str(Path(sys.executable).with_name("idemq"))

UNREACHABLE = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:{port}/",
    "kafka": "kafka://127.0.0.1:{port}",
    "nats": "nats://127.0.0.1:{port}",
    "redis_streams": "redis://127.0.0.1:{port}/0",
    "mqtt": "mqtt://127.0.0.1:{port}",
}


def worker(tmp_path: Path, broker: str, *extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    store = f"sqlite:///{tmp_path / 'store.db'}"
    command = [IDEMQ, "worker", "fine:handle", "--queue", "orders"]
    return subprocess.run(
        [*command, "--store", store, *extra],
        # The broker URL holds a password: from the environment, as in production, so the
        # only stderr lines are the ones these tests are about (not the argv warning).
        env={**os.environ, "IDEMQ_BROKER_URL": broker},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("kind", sorted(UNREACHABLE))
def test_an_unreachable_broker_is_retried_then_exit_4(tmp_path, kind):
    broker = UNREACHABLE[kind].format(port=closed_port())
    done = worker(tmp_path, broker, "--give-up-after", "2")
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr
    assert "idemq worker ready" not in done.stderr
    *records, last = done.stderr.splitlines()
    for line in records:
        assert RECORD_START.match(line), line
    attempts = [line for line in records if re.search(r"failed \(attempt \d+\), retrying", line)]
    given_up = re.match(r"broker unavailable: .*gave up after (\d+) attempts? in", last)
    assert given_up, last
    assert int(given_up.group(1)) == len(attempts) + 1  # one line for each attempt retried


@pytest.mark.parametrize("kind", sorted(UNREACHABLE))
def test_give_up_after_is_kept_on_every_broker(tmp_path, kind):
    # Kafka and NATS wait 10 s for a connect: one attempt must not outlast the budget, and the
    # budget runs from the first attempt, not from its failure (it took 22 s for 3).
    broker = UNREACHABLE[kind].format(port=closed_port())
    started = time.monotonic()
    done = worker(tmp_path, broker, "--give-up-after", "3")
    took_s = time.monotonic() - started
    assert done.returncode == 4, done.stderr
    assert took_s <= 3 + 5, (took_s, done.stderr)  # the bound, plus the process's start-up


def test_rabbitmq_refused_login_is_exit_2_at_once(tmp_path):
    require_service("rabbitmq")
    done = worker(tmp_path, "amqp://guest:not-the-password@127.0.0.1:5672/")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: RabbitMQ refused the login (check the URL's user and password): ACCESS_REFUSED"
        " - Login was refused using authentication mechanism PLAIN. For details see the broker"
        " logfile."
    ]


def test_rabbitmq_unknown_vhost_is_exit_2_at_once(tmp_path):
    require_service("rabbitmq")
    done = worker(tmp_path, "amqp://guest:guest@127.0.0.1:5672/no-such-vhost-cli20")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: RabbitMQ closed the connection at login: vhost 'no-such-vhost-cli20' does not"
        " exist or the user may not use it"
    ]


RETRIED = re.compile(
    r" WARNING idemq\.outage (.*) failed \(attempt \d+\), retrying in [\d.]+s:"
    r" BrokerUnavailableError: "
)


def test_worker_and_its_relay_wait_out_a_broker_outage_alike_then_exit_4(tmp_path):
    """One outage policy per process: the relay thread logs its retries as the consumer does
    and is bound by the same --give-up-after (it used to retry for ever)."""
    require_service("redis")
    (tmp_path / "fine.py").write_text("def handle(msg, tx):\n    return 1\n")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    queue, table = unique("q"), unique("ob")
    store = idemq.SqlStore(store_url)
    outbox = idemq.Outbox(store, table=table)
    outbox.create_schema()
    proxy = CuttableProxy(("127.0.0.1", 6379))
    stderr_path = tmp_path / "stderr.txt"
    command = [IDEMQ, "worker", "fine:handle", "--queue", queue, "--store", store_url]
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [*command, "--relay", "--outbox-table", table, "--give-up-after", "3"],
            env={**os.environ, "IDEMQ_BROKER_URL": f"redis://127.0.0.1:{proxy.port}/0"},
            cwd=tmp_path,
            stderr=stderr,
            text=True,
        )
    try:
        _wait_for(lambda: "idemq worker ready" in stderr_path.read_text(), 30)
        proxy.cut()
        with outbox.engine.begin() as conn:  # the relay meets the outage at this row's publish
            outbox.add(conn, queue, b"ship")
        cut_at = time.monotonic()
        code = proc.wait(60)
        took_s = time.monotonic() - cut_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proxy.close()
        outbox.drop_schema()
        store.close()
    log = stderr_path.read_text()
    assert code == 4, log
    assert took_s <= 3 + 3, (took_s, log)  # the budget, plus a poll and the last round
    assert "Traceback" not in log
    retried = {m.group(1) for m in map(RETRIED.search, log.splitlines()) if m}
    assert f"consuming {queue}" in retried, log
    assert any(doing.startswith("relaying ") for doing in retried), log
    assert re.search(r"gave up after \d+ attempts? in", log.splitlines()[-1]), log


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
