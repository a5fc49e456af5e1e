"""URLs with passwords stay off the command line: every URL option reads ``IDEMQ_<NAME>_URL`` when
it is absent, and a password given in argv (which ``ps`` shows to every local user) is accepted
with one warning line naming the variable, never the password. Real PostgreSQL, RabbitMQ and
subprocesses of the ``idemq`` script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from idemq.brokers.embedded import EmbeddedBroker
from tests.conftest import PG_URL, require_service, unique

IDEMQ = str(Path(sys.executable).with_name("idemq"))
PASSWORD = "s3cret-Pw-42"
URL_VARIABLES = ("IDEMQ_STORE_URL", "IDEMQ_BROKER_URL", "IDEMQ_LEDGER_URL")


def pg_url_with_password() -> str:
    """The test server's URL with a password in it (the server trusts local logins, so the
    password is carried and ignored: what matters is where it shows)."""
    require_service("postgres")
    url = make_url(PG_URL).set(password=PASSWORD)
    return url.render_as_string(hide_password=False)


def idemq_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if key not in URL_VARIABLES}
    return subprocess.run(
        [IDEMQ, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, **(env or {})},
        cwd=cwd,
    )


@pytest.fixture
def pg_table() -> str:
    """A dedup table on the PostgreSQL server, created through the library."""
    table = unique("sec_dedup")
    done = idemq_cli("schema", "--store", PG_URL, "--table", table, "--no-outbox")
    assert done.returncode == 0, done.stderr
    return table


def test_store_url_from_the_environment_and_no_warning(pg_table: str) -> None:
    done = idemq_cli(
        "stats", "--table", pg_table, "--json", env={"IDEMQ_STORE_URL": pg_url_with_password()}
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 0
    assert done.stderr == ""


def test_a_password_in_argv_is_accepted_with_one_warning_naming_the_variable(
    pg_table: str,
) -> None:
    done = idemq_cli("stats", "--store", pg_url_with_password(), "--table", pg_table, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "WARNING" in lines[0]
    assert "IDEMQ_STORE_URL" in lines[0]
    assert PASSWORD not in done.stderr
    assert PASSWORD not in done.stdout


def test_a_url_without_a_password_in_argv_gives_no_warning(pg_table: str) -> None:
    done = idemq_cli("stats", "--store", PG_URL, "--table", pg_table, "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_the_command_line_wins_over_the_environment(pg_table: str, tmp_path: Path) -> None:
    elsewhere = f"sqlite:///{tmp_path / 'absent.db'}"
    done = idemq_cli(
        "stats", "--store", PG_URL, "--table", pg_table, "--json",
        env={"IDEMQ_STORE_URL": elsewhere},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["store"].startswith("postgresql")


def test_no_url_anywhere_is_a_usage_error_naming_the_option() -> None:
    done = idemq_cli("stats")
    assert done.returncode == 2
    assert "--store" in done.stderr


def test_a_broker_password_in_argv_names_its_own_variable(tmp_path: Path) -> None:
    require_service("rabbitmq")
    queue = unique("sec_q")
    done = idemq_cli(
        "publish", "{}", "--queue", queue, "--broker", "amqp://guest:guest@127.0.0.1:5672/"
    )
    # Nobody declared the queue: refused (exit 4), after the one warning line.
    assert done.returncode == 4, done.stderr
    warning = done.stderr.strip().splitlines()[0]
    assert "IDEMQ_BROKER_URL" in warning
    assert "IDEMQ_STORE_URL" not in warning
    assert "guest:guest" not in done.stderr


def test_schema_creates_tables_only_when_asked_even_with_the_variable_set() -> None:
    # A variable set for the other commands must not turn "print the DDL" into "create tables".
    table = unique("sec_schema")
    printed = idemq_cli("schema", "--table", table, env={"IDEMQ_STORE_URL": PG_URL})
    assert printed.returncode == 0, printed.stderr
    assert "CREATE TABLE" in printed.stdout
    engine = sa.create_engine(PG_URL)
    with engine.connect() as conn:
        assert not sa.inspect(conn).has_table(table)
    created = idemq_cli("schema", "--store", "--table", table, env={"IDEMQ_STORE_URL": PG_URL})
    assert created.returncode == 0, created.stderr
    with engine.connect() as conn:
        assert sa.inspect(conn).has_table(table)
    engine.dispose()


HANDLER = """
import sqlalchemy as sa

def handle(msg, tx):
    tx.execute(sa.text("INSERT INTO {effects} (message_id) VALUES (:m)"), {{"m": msg.id}})
"""


def test_a_worker_with_its_urls_in_the_environment_keeps_them_out_of_ps(tmp_path: Path) -> None:
    store_url = pg_url_with_password()
    effects, table = unique("sec_effects"), unique("sec_dedup")
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {effects} (message_id TEXT)")
    (tmp_path / "secret_handlers.py").write_text(HANDLER.format(effects=effects))
    broker = EmbeddedBroker(tmp_path / "q.db")
    for message_id in ("A", "B", "A"):  # a producer retry: A twice
        broker.publish("orders", b"{}", message_id=message_id)
    broker.close()
    env = {key: value for key, value in os.environ.items() if key not in URL_VARIABLES}
    env |= {"IDEMQ_STORE_URL": store_url, "IDEMQ_BROKER_URL": f"embedded:///{tmp_path / 'q.db'}"}
    log = tmp_path / "worker.log"
    with log.open("w") as sink:
        worker = subprocess.Popen(
            [IDEMQ, "worker", "secret_handlers:handle", "--queue", "orders", "--table", table],
            cwd=tmp_path,
            env=env,
            stdout=sink,
            stderr=sink,
        )
        try:
            deadline = time.monotonic() + 60
            count = 0
            while time.monotonic() < deadline:
                assert worker.poll() is None, log.read_text()
                with engine.connect() as conn:
                    count = conn.exec_driver_sql(f"SELECT COUNT(*) FROM {effects}").scalar_one()
                if count == 2:
                    break
                time.sleep(0.1)
            assert count == 2, log.read_text()
            # What every local user sees of the worker: its command line, without the password.
            cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes().decode()
            assert PASSWORD not in cmdline
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    with engine.connect() as conn:
        ids = conn.exec_driver_sql(f"SELECT message_id FROM {effects} ORDER BY 1").scalars().all()
    assert ids == ["A", "B"]
    assert PASSWORD not in log.read_text()
    engine.dispose()


def test_passwords_in_two_options_make_one_warning_line_naming_both_variables() -> None:
    require_service("rabbitmq")
    outbox = unique("sec_outbox")  # no such table: the relay stops at once, exit 2
    done = idemq_cli(
        "relay", "--store", pg_url_with_password(), "--outbox-table", outbox,
        "--broker", "amqp://guest:guest@127.0.0.1:5672/",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, done.stderr
    assert "IDEMQ_STORE_URL" in warnings[0]
    assert "IDEMQ_BROKER_URL" in warnings[0]
    assert PASSWORD not in done.stderr
    assert "guest:guest" not in done.stderr


def test_main_called_from_python_with_a_password_warns_only_if_it_is_in_the_process_argv(
    pg_table: str,
) -> None:
    # A program that calls idemq.cli.main([...]) with a URL it built (a manage.py command from
    # its settings) does not put the password in `ps`: no warning for what no one can see.
    script = (
        "import os, sys\n"
        "from idemq.cli import main\n"
        "url = os.environ.pop('SECRET_TEST_URL')\n"
        f"sys.exit(main(['stats', '--store', url, '--table', {pg_table!r}, '--json']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "SECRET_TEST_URL": pg_url_with_password()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 0
    assert done.stderr == ""
